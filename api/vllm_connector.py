"""Stable import path for vLLM's `kv_connector_module_path` (`"api.vllm_connector"`,
`"kv_connector": "SidecarConnector"`); the code lives in `api.engine.vllm_connector`."""

from api.engine.vllm_connector import SidecarConnector

__all__ = ["SidecarConnector"]
