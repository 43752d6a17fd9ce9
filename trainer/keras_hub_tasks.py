"""A keras-hub task model as it is: its preprocessor mapped over every input_fn's batches.

A keras-hub task (``BertTextClassifier``, ``GPT2CausalLM``, ...) holds a preprocessor
that makes the backbone's inputs of raw data (token ids and a padding mask of
strings), and its ``fit`` maps that preprocessor over the batches it is given. The
model itself refuses strings. Given to the Estimator, a task is trained the same way:

* every input_fn's batches go through ``task.preprocess_samples`` before the model
  sees them, in tf.data, as ``fit`` does; the map keeps each batch's place in the
  stream, so a positioned stream still resumes at its exact batch;
* the export takes what the input_fn yields (strings), and runs the preprocessor
  inside the SavedModel; ``trainer.load_export`` imports keras_hub first, which
  registers tensorflow-text's ops;
* a causal LM (``GPT2CausalLM``, ...) predicts as its ``generate`` does: each prompt
  through ``generate_preprocess``, continued by ``generate_step`` with the sampler it
  was compiled with until its end token or its preprocessor's sequence length, then
  its ``token_ids`` and ``text`` (``generator``); its export too.

A preprocessor that draws random numbers (a masked LM's masking) is mapped too, but
is not replayed exactly on resume: tf.data draws them afresh. One that memoizes in a
mutable table (GPT-2's byte-pair tokenizer) keeps no state that changes a batch, so
the training iterator is saved through it (``experimental_external_state_policy``).

Nothing here imports keras_hub: a task is known by what it has, so the framework
runs without the ``text`` extra installed.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf
from absl import logging

from trainer import dataset_marks, serving
from trainer.errors import UserError
from trainer.model_fn import Mode, labeled, split_element
from trainer.serving import Serving

# What an export of a task imports before loading: keras_hub registers its layers,
# and imports tensorflow_text, whose ops (WordPiece, SentencePiece) the preprocessor runs.
IMPORTS = ("keras_hub",)


def _savable() -> tf.data.Options:
    """Options that let a checkpoint save an iterator through the preprocessor.

    A byte-pair tokenizer (GPT-2's) memoizes words in a mutable lookup table, which
    tf.data calls stateful and will not save an iterator through; the cache changes no
    batch, so the iterator is saved without it.
    """
    options = tf.data.Options()
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    return options


_SAVABLE = _savable()


def is_task(model: keras.Model) -> bool:
    """Whether ``model`` is a keras-hub task with a preprocessor (``fit`` maps it)."""
    return callable(getattr(model, "preprocess_samples", None)) and (
        getattr(model, "preprocessor", None) is not None
    )


def input_map(
    model: keras.Model, generates: bool = True
) -> Callable[[tf.data.Dataset, Mode], tf.data.Dataset] | None:
    """How an input_fn's dataset reaches ``model``: its preprocessor mapped; None for others."""
    if not is_task(model):
        return None
    _check_lengths(model)
    if hasattr(model.preprocessor, "mask_selection_rate"):  # a masked LM's
        logging.warning(
            "%s masks tokens at random in tf.data: a resumed run starts at its exact batch "
            "but draws that batch's masks anew, so it does not end bit for bit where an "
            "unbroken run does",
            type(model.preprocessor).__name__,
        )

    def mapped(dataset: tf.data.Dataset, mode: Mode) -> tf.data.Dataset:
        with_labels = labeled(dataset.element_spec)

        def preprocess(*element):
            if not with_labels:  # PREDICT's bare features
                return model.preprocess_samples(element[0] if len(element) == 1 else element)
            return model.preprocess_samples(*element)

        features_spec, _ = split_element(dataset.element_spec, mode)
        _check_takes_text(model, features_spec)
        exported = exported_serving(model, features_spec, serving.declared(dataset), generates)
        if mode == Mode.PREDICT and generates and is_generator(model):  # generate's prompts
            preprocess = model.preprocessor.generate_preprocess
        preprocessed = dataset.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
        return dataset_marks.put(preprocessed.with_options(_SAVABLE), "serving", exported)

    return mapped


def is_generator(model: keras.Model) -> bool:
    """Whether ``model`` is a task that continues text (a ``CausalLM``: ``generate``)."""
    return (
        is_task(model)
        and callable(getattr(model, "generate_step", None))
        and callable(getattr(model.preprocessor, "generate_preprocess", None))
    )


def generator(model: keras.Model) -> Callable[[dict], dict] | None:
    """PREDICT's outputs of a causal LM, as its ``generate`` makes them; None for others.

    ``generate(features)`` takes ``generate_preprocess``'s prompts and returns
    ``{'token_ids': [b, sequence_length], 'padding_mask': [b, sequence_length],
    'text': [b]}``: each prompt continued by the
    compiled sampler (``compile(sampler=...)``, keras-hub's default ``'top_k'``) until
    the tokenizer's end token, the text as ``generate`` returns it (the prompt, then
    what follows). keras-hub 0.32's ``generate_postprocess`` reads numpy and cannot run
    in a graph, so the same stripping and detokenizing is done here in TensorFlow.
    """
    if not is_generator(model):
        return None
    tokenizer = model.preprocessor.tokenizer
    stop = [tokenizer.end_token_id]
    stop += [tokenizer.end_token2_id] if hasattr(tokenizer, "end_token2_id") else []

    def generate(features: dict) -> dict:
        outputs = model.generate_step(features, stop_token_ids=stop)
        shown = tf.cast(outputs["padding_mask"], tf.bool)
        for special in getattr(tokenizer, "special_token_ids", []):
            shown &= outputs["token_ids"] != special
        text = tokenizer.detokenize(tf.ragged.boolean_mask(outputs["token_ids"], shown))
        return {**outputs, "text": text}

    return generate


def _check_takes_text(model: keras.Model, features_spec) -> None:
    """Refuses token ids given to a task whose preprocessor tokenizes text itself.

    keras-hub's tokenizers take strings; given ids (text prepared by
    ``datasets.prepare``), they failed deep inside keras-hub.
    """
    specs = tf.nest.flatten(features_spec)
    if not specs or not all(spec.dtype.is_integer for spec in specs):
        return
    given = ", ".join(f"{s.dtype.name} {s.shape.as_list()}".replace("None", "?") for s in specs)
    raise UserError(
        f"{type(model).__name__} tokenizes text itself ({type(model.preprocessor).__name__} "
        f"takes strings), but the input_fn gives token ids ({given}): give it the text as "
        "strings, or load the task without its preprocessor (hub_task.preprocessor = None) "
        "and give it the inputs its backbone takes"
    )


def _check_lengths(model: keras.Model) -> None:
    """Refuses a preprocessor whose sequences outrun the backbone's learned positions.

    ``from_preset(dir, sequence_length=n)`` on a Hugging Face directory leaves the
    preprocessor at its own length (often 512); the step then failed in the gradient of
    the position embedding ("Paddings must be non-negative").
    """
    length = getattr(model.preprocessor, "sequence_length", None)
    limit = getattr(model.backbone, "max_sequence_length", None)
    if isinstance(length, int) and isinstance(limit, int) and length > limit:
        raise UserError(
            f"{type(model.preprocessor).__name__} makes sequences of {length} tokens, but "
            f"{type(model.backbone).__name__} has positions for {limit}: give the task a "
            f"preprocessor of sequence_length <= {limit} (hub_task.sequence_length in gin)"
        )


def exported_serving(
    model: keras.Model, features_spec, declared: Serving | None, generates: bool = True
) -> Serving:
    """What an export of ``model`` takes: the input_fn's features, preprocessed inside.

    ``features_spec`` is the input_fn's (not the preprocessed) batch of features;
    ``declared``, what its dataset was marked with (``trainer.serves``), if anything:
    then the export takes the stored examples it declares, and runs its
    ``features_of`` before the preprocessor. ``generates``: a causal LM's export
    continues prompts (else it gives the task's outputs, its logits).
    """
    generates = generates and is_generator(model)
    if declared is not None:
        return Serving(
            _Preprocessed(model, generates, declared.features),
            declared.stored,
            declared.parse_examples,
            batched=True,
            imports=(*declared.imports, *IMPORTS),
        )
    if isinstance(features_spec, dict):
        stored = {name: _one_example(spec) for name, spec in features_spec.items()}
        return Serving(_Preprocessed(model, generates), stored, batched=True, imports=IMPORTS)
    stored = {"x": _one_example(features_spec)}
    preprocessed = _Preprocessed(model, generates, lambda s: s["x"])
    return Serving(preprocessed, stored, batched=True, imports=IMPORTS)


class _Preprocessed(tf.Module):
    """A batch of stored features -> the task's inputs, by its preprocessor.

    A module, so that the export tracks the preprocessor: its vocabulary's tables are saved.
    """

    def __init__(self, model: keras.Model, generates: bool, features_of: Callable | None = None):
        super().__init__(name="task_preprocessing")
        self.preprocessor = model.preprocessor
        self._task, self._generates, self._features_of = model, generates, features_of
        # A causal LM's sampler (top_k's seed state): the export generates, and saves
        # only the variables something in it tracks.
        sampler = getattr(model, "sampler", None) if generates else None
        self.sampler_variables = list(getattr(sampler, "variables", []))

    def __call__(self, stored: dict):
        x = stored if self._features_of is None else self._features_of(stored)
        if self._generates:  # prompts, continued in the export
            return self.preprocessor.generate_preprocess(x)
        features, _, _ = keras.utils.unpack_x_y_sample_weight(self._task.preprocess_samples(x))
        return features  # a causal LM's preprocessor makes its labels too


def _one_example(spec: tf.TensorSpec) -> tf.TensorSpec:
    """``spec`` without its batch dimension."""
    return tf.TensorSpec(spec.shape[1:], spec.dtype)
