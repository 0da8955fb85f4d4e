"""The trainer's weight sync (docs/spec.md sections 5.4 item 4 and 6.11): pushing a new
policy version to every policy server, retried under one request id per (epoch,
version, server), recorded in each snapshot and pushed again after a restore. The
retry decisions are pure (``core``); ``sync`` drives them over gRPC.

Nothing is imported here, so a pure module of this package imports alone.
"""
