"""The issue's acceptance check, literally: an ``openai`` program and an SGLang frontend program,
unchanged, against ``mrl engine`` started as users start it (a ``python -m mrl.rollout.engine.server``
process)."""
from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest

from tests.helpers.dist import free_port
from tests.helpers.serving import wait_http_ok
from tests.helpers.sglang_real import require
from tests.helpers.tiny_models import make_tiny_hf
from tests.helpers.tiny_tokenizer import add_chat_template

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow
def test_openai_and_sglang_programs_against_mrl_engine(tmp_path):
    sgl = require()
    d = make_tiny_hf(tmp_path / "m", "llama")
    add_chat_template(d)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "mrl.rollout.engine.server", "--model", str(d), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url, proc)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}])
        assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 4
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt="2+2=", max_tokens=4, temperature=0, stream=True) if c.choices)
        assert text == client.completions.create(model="m", prompt="2+2=", max_tokens=4, temperature=0).choices[0].text

        @sgl.function
        def qa(s):
            s += "Q: 2+2? A:" + sgl.gen("a", max_tokens=4, temperature=0)
            s += " Sure?" + sgl.select("b", choices=[" yes", " no"])

        sgl.set_default_backend(sgl.RuntimeEndpoint(url))
        state = qa.run()
        assert state["b"] in (" yes", " no") and isinstance(state["a"], str)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
