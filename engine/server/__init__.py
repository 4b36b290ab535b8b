"""The rollout HTTP server: SGLang native API, OpenAI completions, metrics, live control."""
