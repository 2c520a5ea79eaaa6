"""The scripted model: a deterministic, scriptable model server that speaks OpenAI's Chat Completions and
Responses APIs, Anthropic's Messages API and Gemini's generateContent, so litellm's real code paths run
without a provider key. The demo's default model, the model of the test suite, and a model a host site
can run to try the apps (`think-scripted-model`, or `python -m think_scripted`).

- `think_scripted.server`: the server, its prompt directives and `ScriptedModelServer` (tests);
- `think_scripted.responses`, `think_scripted.dialects`: the other APIs on the same server;
- `think_scripted.kwargs`: litellm's arguments to reach it (`THINK["MODEL"]`, `THINK["LITELLM_MODELS"]`).
"""
