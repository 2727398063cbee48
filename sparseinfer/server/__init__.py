"""OpenAI-compatible HTTP server: `protocol` (request/response shapes), `app` (routing, `create_app`),
`engine` (one worker thread owns the model and interleaves up to `--parallel` sequences), `cli`
(`sparseinfer serve`). Needs the `[server]` extras (fastapi, uvicorn, pydantic)."""
