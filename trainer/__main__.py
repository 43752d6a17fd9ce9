"""``python -m trainer``: see trainer/cli.py."""

from absl import app

from trainer import cli

if __name__ == "__main__":
    app.run(cli.main, flags_parser=cli.parse_flags)
