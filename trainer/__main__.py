"""``python -m trainer``: see trainer/command.py (flags) and trainer/cli.py (the run)."""

from absl import app

from trainer import command

if __name__ == "__main__":
    app.run(command.main, flags_parser=command.parse_flags)
