"""What the tests share, by job (the conftest.py files hold only fixtures and pytest hooks):

- models: the tiny random models built from configs with a fixed seed, their device, and random prompts.
- oracle: the generation oracle, transformers' own `model.generate`, and the parity assertion against it.
- engine_runs: greedy runs through a `ContinuousBatchingManager`, injected forward faults, and the one
  accessor to a manager's `EngineCore` for white-box tests of the engine core.
- servers: real cbserve servers on loopback (in-process or `cbserve serve` subprocesses), their probes
  and the byte tokenizer they serve with.
- certificates: the CA and certificates of the TLS tests.
- structured_output: JSON schemas, and a started manager with room for a batch of structured-output
  requests.
- sdk_fakes: fake servicers behind a real gRPC server, for the Python SDK tests (no engine, no torch).
- gateway: the SMG gateway in front of `cbserve serve` replicas.
- reliability: the prompt pool, outcomes and figures of the reliability suites.
"""
