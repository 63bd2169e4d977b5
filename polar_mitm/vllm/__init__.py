"""vLLM as a production engine: its launch (`polar-mitm vllm serve`), its worker extension for weight reloads and
the scripted test policy. The gateway's translation between SGLang's engine contract (what the gateway speaks) and
vLLM's API is the vLLM dialect, `polar_mitm/engines/dialects/vllm.py`.

Two sides, two environments: `launcher.py`, `worker_extension.py` and `scripted.py` run inside vLLM's own venv
(`.venv-vllm`, scripts/setup-vllm.sh) and import only the standard library, vLLM (with its torch and transformers)
and the standard-library-only script format; `server.py` and `cli.py` run in the project's venv and never import
vLLM. See recipes/vllm.md.
"""

# Shared by both sides (server.py starts vLLM with them, scripted.py runs inside it).
SCRIPTED_POLICY = "polar_mitm.vllm.scripted:ScriptedPolicy"  # the test policy's `--logits-processors` entry
SCRIPT_ENV = "POLAR_VLLM_SCRIPT"  # the script it plays from the start
