"""Chats for post-training: their templates, and (to come) chats and pairs in shards.

* ``templates``: a Hugging Face chat template (Jinja) renders a chat to its text and
  marks the assistant's spans (``{% generation %}``), what a loss on the assistant's
  tokens alone is made from.
"""
