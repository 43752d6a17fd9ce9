"""Shared fixtures: absl flags parsed, gin cleared between tests, one TFDS data dir,
and a trained model_dir to make mistakes against."""

import contextlib
import fcntl
import os
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Two pytest-xdist workers, and the commands they start, share the machine's cores: one
# thread per op each (this process's and, inherited, every command's) rather than each
# spreading every op over all the cores and switching among the others' threads.
# A whole run: 9% less wall on CPU-bound files (tests/test_groups.py, test_keras_model.py).
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")

import gin  # noqa: E402
import pytest  # noqa: E402
from absl import flags  # noqa: E402

from tests.support.as_typed import copy_clone  # noqa: E402
from tests.support.commands import ENV, REPO, run_cli  # noqa: E402
from tests.support.forked import Commands  # noqa: E402

# absl flags are unparsed under pytest; library code that reads them would raise.
flags.FLAGS.mark_as_parsed()


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def shared(tmp_path_factory, name: str):
    """A directory all of this session's processes share (pytest-xdist's workers), held
    under an exclusive lock while the block makes what goes in it; yields its path."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's, above each worker's own
    directory = root / name
    directory.mkdir(exist_ok=True)
    return directory


@contextlib.contextmanager
def locked(directory):
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def forked_cli():
    """``python -m trainer`` forked from one process of this pytest process's that has
    imported it (``tests/support/forked.py``): ``forked_cli.run(*args)``."""
    commands = Commands()
    yield commands
    commands.close()


@pytest.fixture(scope="session")
def forked_prepare():
    """``python -m datasets.prepare`` forked the same way: ``forked_prepare.run(*args)``."""
    commands = Commands("datasets.prepare")
    yield commands
    commands.close()


@pytest.fixture
def clone(tmp_path):
    """A copy of the repository's files as a fresh clone has them, to run commands in."""
    return copy_clone(tmp_path / "tf-trainer")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A TFDS data_dir of this test session's (digits get built into it once, under
    ``datasets.digits``'s own lock)."""
    return str(shared(tmp_path_factory, "tensorflow_datasets"))


@pytest.fixture(scope="session")
def faulty_gin(tmp_path_factory, data_dir):
    """digits_mlp, fed by faulty_digits (no fault unless a test binds one)."""
    directory = shared(tmp_path_factory, "gin")
    path = directory / "faulty.gin"
    text = (
        f"include '{REPO}/experiments/digits_mlp.gin'\n"
        "import faulty\n"
        "experiment.input_fn = @faulty_digits\n"
        "experiment.max_steps = 100\n"
        "experiment.eval_every_steps = None\n"
        "Checkpoints.every_steps = 50\n"
        "Estimator.log_every_steps = 50\n"
        f"digits.input_fn.data_dir = '{data_dir}'\n"
    )
    with locked(directory):  # written once: another process may be reading it
        if not path.exists():
            (directory / "faulty.gin.new").write_text(text)
            os.replace(directory / "faulty.gin.new", path)
    return str(path)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, faulty_gin):
    """A model_dir trained to step 100 with checkpoints at 50 and 100, trained once for
    the session's processes (tests make their mistakes against copies: ``model_dir``)."""
    directory = shared(tmp_path_factory, "trained")
    model_dir = directory / "run"
    with locked(directory):
        if not (model_dir / "ckpt-100.index").exists():
            shutil.rmtree(model_dir, ignore_errors=True)
            proc = run_cli("--gin_file", faulty_gin, "--model_dir", str(model_dir), env=ENV)
            assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(f for f in os.listdir(model_dir) if f.endswith(".index")) == [
        "ckpt-100.index",
        "ckpt-50.index",
    ]
    return model_dir


@pytest.fixture
def model_dir(trained, tmp_path):
    """A copy of ``trained`` for one test to make its mistake against."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy
