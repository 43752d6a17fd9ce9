"""``python -m trainer``: see trainer/cli.py."""

import os

# Keep TensorFlow's C++ start-up chatter (CUDA probing on CPU machines) off the console.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402

from trainer import cli  # noqa: E402

if __name__ == "__main__":
    app.run(cli.main)
