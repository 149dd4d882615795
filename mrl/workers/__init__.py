"""Per-rank Megatron train workers: actor, reference, critic (plain classes; the Ray layer wraps them).

Import the submodules directly (``from mrl.workers.actor import ActorWorker``); this package
imports nothing heavy so that ``mrl.workers.batch`` / ``minibatch`` stay cheap for the driver.
"""
