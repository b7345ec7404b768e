"""A real llama-server (llama.cpp, from the ``xllamacpp`` wheel) beside the simulator, for the tests."""
