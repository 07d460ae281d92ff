"""Engines that use rayload as their weight loader. Each module here is the only one that
imports its engine (``rayload.integrations.vllm`` imports vLLM); rayload's core never does."""
