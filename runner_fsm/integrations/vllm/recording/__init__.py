"""The recorder: what one rank writes of vLLM's steps, and what it reads to write it.

`recorder` (`ReplicaRecorder`: step ids, the state machine of `fsm`, the audit log, the
`journal` of vLLM's own decisions), `probe` (the persistent input buffers a forward reads),
`forwards` (vLLM's forward context), `flight` (PyTorch's Flight Recorder), `rundir` (where a
rank sits and which run it writes), `engine_stops` (a served job's stop, recorded before vLLM
kills the workers) and `replica_check` (a replica's ranks compare their step decisions).
"""
