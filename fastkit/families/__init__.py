"""Model families: proving a registry row and patching a model by it.

    twins.py    tiny random models (and in-process tokenizers) built from a family's config: what tests,
                notebooks in CI and the self-check run on
    census.py   proves a row on a twin: packed parity of logits and every gradient, attention run per
                document, syncs, MoE parity, revert (``check_family``, ``self_check`` for types with no row)
    patch.py    patches a loaded model by its row (``patch_with_facts``) and writes the load banner (``LoadReport``)
    load.py     what ``FastModel`` does with a built model: patch it by its row or the self-check
                (``patch_model``), and the ``twin=True`` load (``load_twin``)
    vision.py   vision-language twins and processors from the row's ``vision`` facts; ``wants_vision`` (load as
                image-text-to-text?) and ``load_processor`` (a checkpoint's processor)

The facts themselves live in one table, :mod:`fastkit.registry`.
"""
