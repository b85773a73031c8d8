"""Integrations with serving engines.

``tiered_kv.integrations.vllm`` imports vLLM and is loaded only when asked
for (by vLLM itself, through ``spec_module_path``).  ``scheduler`` (vLLM's
scheduler-side calls on the tier core), ``copier`` (the worker-side copies on
the movers) and ``slab`` (the host slab shared by the engine's processes) are
the engine-independent halves and need nothing beyond tiered_kv's own
dependencies.
"""

__all__: list[str] = []
