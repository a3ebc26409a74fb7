"""A vLLM-faithful engine simulator: OpenAI API, vLLM metrics, paged KV cache with
prefix caching, continuous batching with chunked prefill and preemption, and a
step-time cost model per hardware profile. ``python -m loadtest.sim_engine --help``.
"""

from loadtest.sim_engine.engine import SimEngine
from loadtest.sim_engine.profiles import PROFILES, Profile, get_profile
from loadtest.sim_engine.server import create_app, serve

__all__ = ["PROFILES", "Profile", "SimEngine", "create_app", "get_profile", "serve"]
