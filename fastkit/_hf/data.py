"""Data, tokenizers and processors: pandas DataFrames, ``datasets``' Json feature, byte-level BPE in
``tokenizer.json``, processor classes without torchvision. Part of :mod:`fastkit._hf` (its docstring says the rules).
"""

from __future__ import annotations

import sys
from typing import Any


def is_pandas_dataframe(obj: Any) -> bool:
    """A pandas ``DataFrame``, recognized without importing pandas (absent where it is not installed).
    checked: pandas 3.1. Can go when pandas is a dependency (then ``isinstance`` directly); it is optional today.
    """
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(obj, pandas.DataFrame)


def has_json_feature(features: Any) -> bool:
    """Whether any (nested) ``datasets`` feature is the ``Json`` type ``load_dataset("json")`` gives a column whose
    type changes from row to row (a string in one row, a number in the next): fastkit refuses such columns.
    checked: datasets 5.2 (``datasets.features.Json``; older releases refuse the file instead: False). Can go when
    ``load_dataset`` can be told to refuse a column of mixed types itself.
    """
    from datasets import features as _features

    json_type = getattr(_features, "Json", None)
    if json_type is None:
        return False
    if isinstance(features, json_type):
        return True
    if isinstance(features, dict):
        return any(has_json_feature(v) for v in features.values())
    if isinstance(features, (list, tuple)):
        return any(has_json_feature(v) for v in features)
    inner = getattr(features, "feature", None)
    return inner is not None and has_json_feature(inner)


BYTE_LEVEL = "ByteLevel"
"""tokenizers' ``"type"`` of its byte-level pre-tokenizer / decoder in ``tokenizer.json`` (tokenizers 0.22)."""


def byte_level_bpe(spec: dict) -> bool:
    """A ``tokenizer.json`` (as a dict) of a byte-level BPE tokenizer: ``model.type`` BPE, a ``ByteLevel``
    pre-tokenizer somewhere in its tree.
    checked: tokenizers 0.23 (the ``tokenizer.json`` layout). Can go when tokenizers exposes the model and
    pre-tokenizer types on the fast tokenizer publicly.
    """
    import json

    return spec.get("model", {}).get("type") == "BPE" and BYTE_LEVEL in json.dumps(spec.get("pre_tokenizer"))


def processor_class(name: str) -> type:
    """transformers' processor class ``name``; where torchvision is missing, a same-named subclass without its video
    processor: ``ProcessorMixin`` checks, saves and loads every attribute its ``__init__`` names, and without
    torchvision ``VIDEO_PROCESSOR_MAPPING`` is a placeholder whose lookup raises (``_extra_content``) even for
    ``video_processor=None``. Images need no torchvision (the ``*ImageProcessorPil`` classes); saves keep the
    upstream class name (a machine with torchvision loads them with ``AutoProcessor``).
    checked: transformers 5.24, 5.25. Can go when ``ProcessorMixin`` accepts a missing video processor without
    torchvision (or fastkit requires torchvision).
    """
    import importlib.util

    import transformers

    cls = getattr(transformers, name)
    if importlib.util.find_spec("torchvision") is not None:
        return cls

    def get_attributes(klass):
        return [a for a in cls.get_attributes() if a != "video_processor"]

    return type(cls.__name__, (cls,), {"get_attributes": classmethod(get_attributes), "__module__": cls.__module__})
