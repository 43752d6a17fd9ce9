"""Chats for post-training: their templates, prepared into shards, read back for SFT.

    python3 -m datasets.prepare --chat chats.jsonl --out data/chats

* ``templates``: a Hugging Face chat template (Jinja) renders a chat to its text and
  marks the assistant's spans (``{% generation %}``), what a loss on the assistant's
  tokens alone is made from;
* ``preparation``: ``prepare --chat``, each chat rendered and tokenized once, its
  tokens and the assistant's mask written as records read by index;
* ``input_fns``: ``chat.input_fn``, a language model's examples of them, their mask
  beside the targets, for a loss on the assistant's tokens.
"""

from datasets.chat import input_fns  # noqa: F401 - registers chat.input_fn in gin
