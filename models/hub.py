"""A keras-hub task model from a preset, for gin: ``Estimator.model_fn = @hub_task()``.

keras-hub's tasks (``TextClassifier``, ``CausalLM``, ``BertTextClassifier``, ...) load
their weights with ``from_preset``: a preset's name downloads it (from Kaggle, or
``hf://owner/model`` from Hugging Face) where there is internet; a directory loads
offline, written by ``task.save_to_preset(dir)`` or laid out as Hugging Face lays out
a model (``config.json``, ``model.safetensors`` and the tokenizer's files). The task
comes with its preprocessor and is compiled as keras-hub compiles it; the Estimator
trains it as it is (``trainer.keras_hub_tasks``). In gin::

    Estimator.model_fn = @hub_task()
    hub_task.task = "TextClassifier"
    hub_task.preset = "/data/presets/bert_tiny"
    hub_task.num_classes = 4
    hub_task.sequence_length = 128
    hub_task.lora_rank = 4

A ``CausalLM`` predicts and exports text continued from the prompts it is given, each
token chosen by ``hub_task.sampler`` (``'greedy'``; keras-hub's default ``'top_k'``).

Needs the ``text`` extra: ``pip install -e ".[text]"``.
"""

from __future__ import annotations

import gin
import keras

from trainer import UserError, errors


@gin.configurable
def hub_task(
    task: str = gin.REQUIRED,
    preset: str = gin.REQUIRED,
    sequence_length: int | None = None,
    lora_rank: int | None = None,
    sampler: str | None = None,
    **kwargs,
) -> keras.Model:
    """``keras_hub.models.<task>.from_preset(preset, **kwargs)``, ready to train.

    Args:
      task: a class of ``keras_hub.models``: ``"TextClassifier"`` (whichever
        architecture the preset holds), ``"CausalLM"``, ``"BertTextClassifier"``, ...
      preset: a preset's name, ``hf://owner/model``, or a directory.
      sequence_length: the preprocessor's length, if not the preset's (often 512).
      lora_rank: train only LoRA adapters of this rank (>= 1) in the backbone
        (keras-hub's ``enable_lora``); None trains every weight.
      sampler: a causal LM's way of choosing each token when it continues prompts
        (``--schedule predict``, the export): ``'greedy'``, ``'top_k'`` (keras-hub's
        default), ``'top_p'``, ``'beam'``, ...; keras-hub's ``compile(sampler=...)``.
      **kwargs: for ``from_preset`` and the task (``num_classes``, ``dropout``, ...).
    """
    errors.check_count("hub_task.sequence_length", sequence_length, optional=True)
    errors.check_count("hub_task.lora_rank", lora_rank, optional=True)
    try:
        import keras_hub
    except ImportError:
        raise UserError(
            'hub_task needs keras-hub: pip install -e ".[text]" (keras-hub, tensorflow-text)'
        ) from None
    cls = getattr(keras_hub.models, task, None)
    if not (isinstance(cls, type) and issubclass(cls, keras_hub.models.Task)):
        raise UserError(
            f"hub_task.task = {task!r} is not a task of keras_hub.models: give one such as "
            "'TextClassifier', 'CausalLM' or 'BertTextClassifier'"
        )
    if sequence_length is not None:
        kwargs["preprocessor"] = _preprocessor(keras_hub, cls, preset, sequence_length)
    try:
        model = cls.from_preset(preset, **kwargs)
    except (ValueError, FileNotFoundError, OSError) as error:
        raise UserError(
            f"hub_task could not load preset {preset!r} as {task}: {errors.first_line(error)} "
            "(a name needs internet; offline, give a directory written by save_to_preset or "
            "in Hugging Face's layout)"
        ) from None
    if lora_rank is not None:
        model.backbone.enable_lora(lora_rank)
    if sampler is not None:
        _set_sampler(keras_hub, model, sampler)
    return model


def _set_sampler(keras_hub, model: keras.Model, sampler: str) -> None:
    """Compiles a causal LM as keras-hub does, with ``sampler``; refuses other tasks."""
    if not isinstance(model, keras_hub.models.CausalLM):
        raise UserError(
            f"hub_task.sampler: {type(model).__name__} does not generate; a sampler is for "
            "a CausalLM task (leave hub_task.sampler unset)"
        )
    model.compile(sampler=sampler)  # keras-hub's optimizer, loss and metrics
    if not isinstance(model.sampler, keras_hub.samplers.Sampler):  # get() gives names back
        raise UserError(
            f"hub_task.sampler = {sampler!r} is not a sampler of keras_hub.samplers: give "
            "'greedy', 'top_k', 'top_p', 'beam', 'random' or 'contrastive'"
        )


def _preprocessor(keras_hub, cls, preset: str, sequence_length: int):
    """The preset's preprocessor for ``cls``, cutting or padding to ``sequence_length``."""
    # A base task (TextClassifier) names its preprocessor's base class after itself.
    named = getattr(keras_hub.models, f"{cls.__name__}Preprocessor", None)
    preprocessor_cls = cls.preprocessor_cls or named
    if preprocessor_cls is None:
        raise UserError(
            f"hub_task.sequence_length: {cls.__name__} names no preprocessor class; "
            "leave sequence_length unset, or give the task's own class (BertTextClassifier)"
        )
    return preprocessor_cls.from_preset(preset, sequence_length=sequence_length)
