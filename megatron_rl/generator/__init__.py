"""The generator side: SGLang engines and what talks to them.

server.py        SGLangServer: one engine's process group (launch, readiness, stop, restart)
client.py        SGLangClient: one engine's native HTTP API (batched generate, pause, weight updates) and
                 the EngineError family
balancer.py      EngineBalancer: several engines as one GenerateFn for the rollout pipeline
weight_sync.py   WeightSender: trainer -> engines weight transfer in flight (gloo/NCCL group or disk)
"""
