"""The run folder's model card: TRL's card with fastkit's sentence naming the base model and the data.

:class:`ModelCardMixin` is the trainers' ``create_model_card`` (a method of fastkit's trainer classes,
:mod:`fastkit.training.base`); :func:`model_card_sentence` the sentence; :func:`is_fastkit_card` tells fastkit's card
from a README.md of the user's, which is kept.
"""

from __future__ import annotations

import json
import logging
import os

from fastkit.families.twins import twin_source
from fastkit.patching import unwrap

logger = logging.getLogger(__name__)


CARD_LINE = "This model is a fine-tuned version of "
"""The sentence of TRL's model card (trl/templates/lm_model_card.md, TRL 1.16) that names the base model and data."""


NO_HUB_MODEL = 'model="None"'
"""TRL's quick-start line names ``hub_model_id``, None for a run not pushed: the card names the adapters' folder."""


def data_name(source) -> str | None:
    """What the model card calls the training data: a path or Hub id as given, a Hub dataset's name, else None."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return getattr(getattr(source, "info", None), "dataset_name", None) or None


def model_card_sentence(base: str | None, data: str | None) -> str:
    """fastkit's line for the run folder's README.md: a Hub id links to the Hub, a local folder or file is named."""
    def named(what: str | None, kind: str) -> str:
        if not what:
            return "a model built in memory" if kind == "models" else "data given in memory"
        if kind == "models" and twin_source(what) is not None:
            return f"a tiny random twin of `{twin_source(what)}` (a smoke test, not a trained model of it)"
        local = os.path.exists(what) or what.startswith((".", "/", "~"))
        hub = "" if kind == "models" else "datasets/"
        return f"`{what}`" if local or what.count("/") != 1 else f"[{what}](https://huggingface.co/{hub}{what})"

    return f"{CARD_LINE}{named(base, 'models')}, trained on {named(data, 'datasets')} with fastkit."


CARD_MARKER = "<!-- fastkit: this model card was written by fastkit; a later run in this folder replaces it -->"
"""The last line of the run folder's README.md fastkit writes: a README.md without it is the user's, and kept."""


def is_fastkit_card(text: str) -> bool:
    """Whether a run folder's README.md is fastkit's model card: its marker, or (a card from before the marker)
    fastkit's sentence naming the base model and data."""
    return CARD_MARKER in text or any(ln.startswith(CARD_LINE) and ln.rstrip().endswith("with fastkit.")
                                      for ln in text.splitlines())


class ModelCardMixin:
    """A trainer whose ``create_model_card`` (TRL's, at every checkpoint and at the end) names the base model (Hub id
    or folder) and the data (``run_record.data``: the CLI's ``--data``, else the dataset's path or Hub name) in its
    sentence, and ends the card with fastkit's marker: TRL's card says "fine-tuned version of [None]" for a model
    loaded from a folder, and names no data.

    The rule for a run folder's README.md: fastkit lets TRL replace only a card fastkit wrote
    (:func:`is_fastkit_card`). A README.md of the user's (or any other tool's, a plain TRL card included) is kept
    byte for byte and the card is not written (said once a trainer)."""

    _card_kept = False

    def create_model_card(self, *args, **kwargs):
        card = os.path.join(self.args.output_dir, "README.md")
        if _users_card(card, self._card_kept):
            self._card_kept = True
            return
        super().create_model_card(*args, **kwargs)
        if os.path.isfile(card):
            base = str(getattr(unwrap(self.model).config, "_name_or_path", "") or "") or None
            _rewrite(card, model_card_sentence(base, self.run_record.data), self.args.output_dir)


def _rewrite(card: str, line: str, output_dir: str) -> None:
    """TRL's card at ``card`` with fastkit's sentence, the adapters' folder named, and fastkit's marker last."""
    with open(card, encoding="utf-8") as f:
        text = f.read()
    lora = os.path.join(output_dir, "lora")  # where fastkit train / save_lora put the adapters
    lines = [line if ln.startswith(CARD_LINE) else ln.replace(NO_HUB_MODEL, f"model={json.dumps(lora)}")
             for ln in text.splitlines()]
    with open(card, "w", encoding="utf-8") as f:
        f.write("\n".join(ln for ln in lines if ln != CARD_MARKER) + "\n\n" + CARD_MARKER + "\n")


def _users_card(card: str, said: bool) -> bool:
    """True when ``card`` exists and is not fastkit's: it is kept, no card is written (said unless ``said``)."""
    if not os.path.lexists(card):
        return False
    try:
        with open(card, encoding="utf-8", errors="replace") as f:
            ours = os.path.isfile(card) and not os.path.islink(card) and is_fastkit_card(f.read(1 << 20))
    except OSError:
        ours = False
    if not ours and not said:
        logger.warning("fastkit: %s is not a model card fastkit wrote: kept as it is, the run's model card is not "
                       "written (move it away to get one)", card)
    return not ours


__all__ = ["CARD_LINE", "CARD_MARKER", "NO_HUB_MODEL", "ModelCardMixin", "data_name", "is_fastkit_card",
           "model_card_sentence"]
