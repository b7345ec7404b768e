"""The real llama-server of the differential tests: the starter lives in the package
(``calconsole.bench.llama_server``), where ``calconsole bench http`` uses it too."""

from calconsole.bench.llama_server import RealLlamaServer, free_port, smollm2_gguf, start_llama_server

__all__ = ["RealLlamaServer", "free_port", "smollm2_gguf", "start_llama_server"]
