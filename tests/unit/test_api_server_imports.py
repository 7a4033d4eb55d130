"""The API server never imports torch (issue 18, start-up): not through its modules, nor through
loading a tokenizer of the generic fast class (``AutoTokenizer``'s import brings torch in through the
model configurations, and its lookup cost seconds). The engine process starts before the API server's
imports (launch/serve.py), so torch there would delay start-up on a 2-core host."""

from __future__ import annotations

import subprocess
import sys


def test_the_api_server_and_its_tokenizer_load_without_torch() -> None:
    code = (
        "import sys\n"
        "import trioserve.launch.serve, trioserve.launch.supervisor, trioserve.frontend.api_server\n"
        "from trioserve.frontend.text.tokenizer import load_tokenizer\n"
        "tokenizer = load_tokenizer(None)\n"  # the built-in Qwen3 folder: tokenizer_class is generic
        "assert tokenizer.encode('hello world'), 'no tokens'\n"
        # Not blocked (transformers would then take torch for absent and skip it): looked for after.
        "assert 'torch' not in sys.modules, 'the API server imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr.strip().splitlines()[-3:]
