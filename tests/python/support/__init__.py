"""Helpers the Python tests share. Test files import from here and never from one another;
conftest.py holds the fixtures.

- paths: the repository, the test models and fixtures, the ringllm binary, the cluster key;
- cli: running the ringllm binary (`run`, `ringllm`, `generation`, `forward_dump`);
- nodes: real `ringllm node` processes on loopback (`Nodes`), free ports, waiting for a port;
- server: a `--serve` process and its HTTP/OpenAI clients (`Server`);
- cgroup: cgroup memory caps for processes (`MemoryCap`; needs root);
- compare: our forward pass against the NumPy reference (`compare`, `rel_l2`);
- netns, wire: network namespaces joined by a bridge or an impaired user-space switch (root).

Runnable tools (the NumPy reference, the fixture makers, the dequantization check) stay beside
the tests in tests/python.
"""
