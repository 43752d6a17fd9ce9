"""``python -m datasets.prepare --text`` given careless and hostile input, as users type it.

Each row of ``ROWS`` is one command run in a folder holding a user's corpus and notes
(``data/reviews/reviews.jsonl``, ``notes.txt``): it must end with exit code 2, one line
on stderr, and every file of the folder byte for byte as it was, with nothing added
(no staging folder left behind). The commands are forks of one process that has
imported what prepare imports (``tests/support/forked.py``). The rows whose input is
fine but was read wrongly before (Windows line ends, ``DOCS.JSONL``, labels ``1`` and
``1.0``, an exact held-out fraction, a long CSV field) check the data written.
"""

import json
import os
import re

import numpy as np
import pytest

from datasets.text import input_fns, preparation, tokenizers, writing
from tests.support import guides
from tests.support.chats import ZEPHYR
from tests.support.helpers import dir_hash
from trainer import UserError

REVIEWS = [
    {"text": f"review {i}: {'good' if i % 2 else 'bad'} film", "label": i % 2} for i in range(20)
]


def _files(tmp_path) -> None:
    """The user's folder: a corpus in data/reviews, notes, a vocabulary, a CSV."""
    (tmp_path / "data" / "reviews").mkdir(parents=True)
    corpus = tmp_path / "data" / "reviews" / "reviews.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in REVIEWS))
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "listed.jsonl").write_text(
        '{"text": "a", "label": "x"}\n{"text": "b", "label": [1]}\n'
    )
    (tmp_path / "ragged.csv").write_text('text,label\n"one",x\ntwo,y,extra\n')
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f(): pass"}]
    for name, chats in (
        ("chats", [good]),
        ("disordered", [good, good[::-1]]),
        ("question", [good[:1]]),
        ("unanswered", [good, [good[0], {"role": "assistant", "content": " "}]]),
    ):
        rows = "".join(json.dumps({"messages": chat}) + "\n" for chat in chats)
        (tmp_path / f"{name}.jsonl").write_text(rows)
    (tmp_path / "zephyr.jinja").write_text(ZEPHYR)  # as it ships: no generation span


CORPUS = "data/reviews/reviews.jsonl"
USERS = ["listed.jsonl", "notes.txt", "ragged.csv", "zephyr.jinja"]  # beside data/
USERS += [f"{name}.jsonl" for name in ("chats", "disordered", "question", "unanswered")]

# Each row: the arguments after `python -m datasets.prepare`, and the line on stderr
# (a regular expression).
ROWS = {
    "out_is_the_working_directory": (
        ["--text", CORPUS, "--out", "."],
        r"--out \. holds files prepare did not write \(chats\.jsonl, data, disordered\.jsonl and "
        r"6 more\): name a new or empty folder; nothing was written",
    ),
    "out_is_the_corpus_folder": (
        ["--text", CORPUS, "--out", "data/reviews"],
        r"--out data/reviews holds files prepare did not write \(reviews\.jsonl\): name a new "
        r"or empty folder; nothing was written",
    ),
    "out_is_the_folder_of_datasets": (
        ["--text", CORPUS, "--out", "data"],
        r"--out data holds files prepare did not write \(reviews\): name a new or empty "
        r"folder; nothing was written",
    ),
    "out_is_a_file": (
        ["--text", CORPUS, "--out", "notes.txt"],
        r"--out notes\.txt is a file: name a folder to write into",
    ),
    "out_cannot_be_written": (
        ["--text", CORPUS, "--out", "/proc/prepared"],
        r"--out /proc/prepared cannot be written \(.*\): choose a folder you can write to",
    ),
    "label_field_misspelt": (
        ["--text", CORPUS, "--out", "out", "--label_field", "lable"],
        r"--label_field lable: no row of data/reviews/reviews\.jsonl has it \(row 1 has 'text', "
        r"'label'\): name the labels' field",
    ),
    "label_field_of_plain_text": (
        ["--text", "notes.txt", "--out", "out", "--label_field", "label"],
        r"--label_field label: notes\.txt is plain text, one document a line, with no fields: "
        r"drop --label_field, or give JSON lines or CSV",
    ),
    "label_a_list": (
        ["--text", "listed.jsonl", "--out", "out"],
        r"listed\.jsonl:2: the label \[1\] is not a class: give a name or a number",
    ),
    "eval_fraction_past_one": (
        ["--text", CORPUS, "--out", "out", "--eval_fraction", "1.5"],
        r"--eval_fraction is the share of the documents held out, from 0 \(none\) to below 1, "
        r"got 1\.5",
    ),
    "eval_fraction_negative": (
        ["--text", CORPUS, "--out", "out", "--eval_fraction=-0.1"],
        r"--eval_fraction is the share .*, got -0\.1",
    ),
    "vocab_without_its_tokenizer": (
        ["--text", CORPUS, "--out", "out", "--vocab", "notes.txt"],
        r"--vocab is read by --tokenizer wordpiece \(a vocab\.txt\) or sentencepiece \(a "
        r"\.model\), not bytes: add --tokenizer wordpiece or --tokenizer sentencepiece",
    ),
    "vocab_size_without_words": (
        ["--text", CORPUS, "--out", "out", "--vocab_size", "100"],
        r"--vocab_size applies to --tokenizer words \(a vocabulary learned from the file\); "
        r"bytes's is fixed: drop it, or add --tokenizer words",
    ),
    "vocab_is_a_folder": (
        ["--text", CORPUS, "--out", "out", "--tokenizer", "wordpiece", "--vocab", "data"],
        r"--vocab data is a folder: name the vocabulary file in it",
    ),
    "text_is_a_folder": (
        ["--text", "data", "--out", "out"],
        r"--text data is a folder: name the file of documents",
    ),
    "text_from_stdin": (
        ["--text", "/dev/stdin", "--out", "out"],
        r"--text /dev/stdin is not a regular file \(a pipe or stdin\?\): prepare reads the file "
        r"twice, to check every row and then to write; save it to a file first",
    ),
    "shards_negative": (
        ["--text", CORPUS, "--out", "out", "--shards=-1"],
        r"--shards must be a whole number >= 1, got -1",
    ),
    "chat_roles_out_of_order": (
        ["--chat", "disordered.jsonl", "--out", "out"],
        r"disordered\.jsonl, chat 2: turn 1 is 'assistant' where 'user' comes: roles go a "
        r"system turn first if any, then user and assistant by turns",
    ),
    "chat_without_an_answer": (
        ["--chat", "question.jsonl", "--out", "out"],
        r"question\.jsonl, chat 1: the chat has no assistant turn, so there is nothing to learn "
        r"from it: drop it, or end it with the answer",
    ),
    "chat_answer_empty": (
        ["--chat", "unanswered.jsonl", "--out", "out"],
        r"unanswered\.jsonl, chat 2: turn 2 \(assistant\) is empty: there is nothing to learn "
        r"from it; drop the chat or give the answer",
    ),
    "chat_template_without_a_generation_span": (
        ["--chat", "chats.jsonl", "--chat_template", "zephyr.jinja", "--out", "out"],
        r"zephyr\.jinja: the chat template marks no \{% generation %\} span, so the "
        r"assistant's tokens cannot be told from the rest: wrap each assistant message in "
        r"\{% generation %\}\.\.\.\{% endgeneration %\} \(Hugging Face's "
        r"return_assistant_tokens_mask needs the same\)",
    ),
    "chat_template_misspelt": (
        ["--chat", "chats.jsonl", "--chat_template", "chat_ml", "--out", "out"],
        r"chat template 'chat_ml': no such file or model directory; name 'chatml', a model "
        r"directory with tokenizer_config\.json or chat_template\.jinja, or a Jinja file",
    ),
    "chat_of_documents": (
        ["--chat", CORPUS, "--out", "out"],
        r"data/reviews/reviews\.jsonl: no column 'messages' \(it has text, label\): name one of "
        r"its columns",
    ),
    "chat_template_for_text": (
        ["--text", CORPUS, "--out", "out", "--chat_template", "chatml"],
        r"--chat_template applies to --chat and --pairs only: drop it",
    ),
    "preset_for_text": (
        ["--text", CORPUS, "--out", "out", "--preset", "presets/gpt2"],
        r"--preset applies to --chat and --pairs only: drop it",
    ),
    "preset_missing": (
        ["--chat", "chats.jsonl", "--out", "out", "--preset", "presets/gpt2"],
        r"--preset presets/gpt2: no such folder; give a directory written by save_to_preset "
        r"or in Hugging Face's layout \(or, with internet, a preset's name\)",
    ),
    "csv_row_ragged": (
        ["--text", "ragged.csv", "--out", "out"],
        r"ragged\.csv:3: 3 fields where the header row has 2: quote a field that holds a comma",
    ),
}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_prepare_mistake_is_one_line_and_nothing_is_lost(row, forked_prepare, tmp_path):
    args, expected = ROWS[row]
    _files(tmp_path)
    before = dir_hash(tmp_path)
    names = sorted(os.listdir(tmp_path))
    proc = forked_prepare.run(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.fullmatch(f"error: {expected}", lines[0]), lines[0]
    assert dir_hash(tmp_path) == before and sorted(os.listdir(tmp_path)) == names


def test_prepare_again_replaces_its_own_files_and_keeps_the_users(forked_prepare, tmp_path):
    """A folder prepare wrote is prepared again in place: its old shards (4, now 2) go,
    a file the user put beside them stays; `--out .` in an empty folder fills it."""
    _files(tmp_path)
    run = [*("--text", CORPUS, "--out", "prepared")]
    assert forked_prepare.run(*run, cwd=tmp_path).returncode == 0
    assert sum(n.startswith("train-") for n in os.listdir(tmp_path / "prepared")) == 4 * 2 + 2
    (tmp_path / "prepared" / "README.md").write_text("prepared from the reviews\n")
    proc = forked_prepare.run(*run, "--shards", "2", "--eval_fraction", "0.25", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:2] == [
        "train: 15 examples in 2 shards",
        "test: 5 examples in 2 shards",
    ]
    assert sorted(os.listdir(tmp_path / "prepared")) == sorted(
        [
            "README.md",
            "dataset.json",
            *(
                f"{s}-0000{i}-of-00002.tfrecord{x}"
                for s in ("train", "test")
                for i in (0, 1)
                for x in ("", ".index")
            ),
            *(f"{s}{end}" for s in ("train", "test") for end in ("-lengths.npy", "-tokens.bin")),
        ]
    )
    assert sorted(os.listdir(tmp_path)) == sorted(["data", *USERS, "prepared"])
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = forked_prepare.run("--text", f"../{CORPUS}", "--out", ".", cwd=empty)
    assert proc.returncode == 0, proc.stderr
    assert "dataset.json" in os.listdir(empty)
    assert sorted(os.listdir(tmp_path)) == sorted(  # no staging folder left beside it
        ["data", "empty", *USERS, "prepared"]
    )


def test_prepare_chat_as_a_command_and_again_as_text_each_replacing_its_own(
    forked_prepare, tmp_path
):
    """`--chat` as typed: its records, answers' starts and template, and no index left
    beside the user's file; `--pairs` too. Prepared again as text in place, the chats'
    own files go (they are prepare's) and the user's note stays."""
    _files(tmp_path)
    proc = forked_prepare.run("--chat", "disordered.jsonl", "--out", "chats", cwd=tmp_path)
    assert proc.returncode == 2  # its second chat is out of order
    proc = forked_prepare.run("--chat", "chats.jsonl", "--out", "chats", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["train: 1 examples in 1 shards", "wrote chats"]
    made = sorted(os.listdir(tmp_path / "chats"))
    assert made == sorted(
        ["chat_template.jinja", "dataset.json", "train-answers.npy", "train-lengths.npy"]
        + ["train-tokens.bin", "train-00000-of-00001.tfrecord"]
        + ["train-00000-of-00001.tfrecord.index"]
    )
    assert sorted(os.listdir(tmp_path)) == sorted(["chats", "data", *USERS])
    pair = {"prompt": "hi", "chosen": "def f(): pass", "rejected": "def f(:"}
    (tmp_path / "data" / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    proc = forked_prepare.run("--pairs", "data/pairs.jsonl", "--out", "data/pairs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["train: 1 examples in 1 shards", "wrote data/pairs"]
    assert json.loads((tmp_path / "data/pairs/dataset.json").read_text())["kind"] == "pairs"
    (tmp_path / "chats" / "README.md").write_text("chats\n")
    proc = forked_prepare.run("--text", CORPUS, "--out", "chats", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    left = set(os.listdir(tmp_path / "chats"))
    assert "README.md" in left and not {"chat_template.jinja", "train-answers.npy"} & left


def _texts(data_dir) -> list[bytes]:
    """The prepared training documents, as bytes, in the file's order."""
    return [bytes(int(i) - 1 for i in ids) for ids in input_fns.documents(str(data_dir), "train")]


def test_files_as_users_write_them_are_read_as_they_mean(tmp_path):
    """Windows line ends, an upper-case extension, labels written 1, 1.0 and "1", a byte
    order mark, and a CSV field longer than csv's 128 KB default."""
    crlf = tmp_path / "windows.txt"
    crlf.write_bytes(b"first line\r\nsecond line\r\n")
    preparation.prepare(str(crlf), str(tmp_path / "crlf"), eval_fraction=0)
    assert _texts(tmp_path / "crlf") == [b"first line", b"second line"]

    upper = tmp_path / "DOCS.JSONL"
    rows = [
        {"text": "one", "label": 1},
        {"text": "two", "label": 1.0},
        {"text": "three", "label": "1"},
        {"text": "four", "label": 2},
    ]
    upper.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    metadata = preparation.prepare(str(upper), str(tmp_path / "upper"), eval_fraction=0)
    assert metadata["classes"] == ["1", "2"]
    assert _texts(tmp_path / "upper") == [b"one", b"two", b"three", b"four"]

    long_field = tmp_path / "long.csv"
    body = "word " * 40_000  # 200 KB
    long_field.write_text(f'text,label\n"{body}",a\nshort,b\n')
    metadata = preparation.prepare(str(long_field), str(tmp_path / "long"), eval_fraction=0)
    assert metadata["splits"]["train"]["longest"] == len(body)


@pytest.mark.parametrize("fraction, held", [(0.1, 2), (0.25, 5), (0.4, 8), (0.9, 18), (0.0, 0)])
def test_the_held_out_fraction_is_the_fraction_asked_for(fraction, held):
    is_held = writing.held_out(fraction)
    chosen = [n for n in range(20) if is_held(n)]
    assert len(chosen) == held == is_held.count(20)
    if held:  # spread evenly: the gaps differ by one at most
        gaps = np.diff([-1, *chosen])
        assert gaps.max() - gaps.min() <= 1


def test_a_vocabulary_of_words_learned_from_any_text_is_read_back(tmp_path):
    """Characters that Python splits lines at (vertical tab, file separators, NEL) are
    spaces to the word splitter too, so vocab.txt keeps one word a line."""
    path = tmp_path / "odd.txt"
    path.write_text("the cat\x0bsat\nthe dog\x1csat on\x85 the mat\u2028ran\n", encoding="utf-8")
    preparation.prepare(str(path), str(tmp_path / "out"), "words", vocab_size=20, eval_fraction=0)
    vocabulary = tokenizers.read_vocabulary(str(tmp_path / "out" / "vocab.txt"))
    assert vocabulary[:4] == ["[PAD]", "[UNK]", "the", "sat"]
    assert sorted(vocabulary[4:]) == ["cat", "dog", "mat", "on", "ran"]


def test_the_api_refuses_what_the_command_refuses(tmp_path):
    with pytest.raises(UserError, match=r"--eval_fraction is the share"):
        preparation.prepare("x.jsonl", str(tmp_path / "out"), eval_fraction=1.0)
    with pytest.raises(UserError, match=r"--shards must be a whole number >= 1, got 0"):
        preparation.prepare("x.jsonl", str(tmp_path / "out"), num_shards=0)
    assert os.listdir(tmp_path) == []


def test_the_guides_table_and_the_rows_agree():
    section = guides.text().split("\n## Preparing data, one line\n", 1)[1].split("\n## ")[0]
    named = re.findall(r"`(\w+)`", "\n".join(re.findall(r"^\|.*\| (`.*`) \|$", section, re.M)))
    assert sorted(named) == sorted(ROWS)
