"""Integrations with serving engines.

``tiered_kv.integrations.vllm`` imports vLLM and is loaded only when asked
for (by vLLM itself, through ``spec_module_path``).  ``slab`` and ``offload``
hold the engine-independent halves and need nothing beyond tiered_kv's own
dependencies.
"""

__all__: list[str] = []
