"""Multi-turn, tool-calling rollouts (docs/agent.md): tools, their subprocess runner, the tool-call
parser, chat-template segments and the agent loop that drives trajectories through the engine pool.

``tools`` and ``parser`` import no torch/Ray/HTTP stack (``mrl plan`` validates the ``agent``
section with them); the loop (``mrl.agent.loop``) is imported by the driver only.
"""
