"""Engines that use rayload as their weight loader. An engine's modules here are the only
ones that import it (``rayload.integrations.vllm`` and ``vllm_trace`` import vLLM);
rayload's core never does."""
