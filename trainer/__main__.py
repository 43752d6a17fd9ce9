"""``python -m trainer``: its flags in trainer/cli/flags.py, its run in cli/experiment.py."""

from absl import app

from trainer.cli import flags

if __name__ == "__main__":
    app.run(flags.main, flags_parser=flags.parse_flags)
