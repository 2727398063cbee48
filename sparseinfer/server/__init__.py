"""OpenAI-compatible HTTP server: `protocol` (request/response shapes), `app` (routing, `create_app`),
`engine` (one worker thread owns the model and interleaves up to `--parallel` sequences), `serve`
(run it with uvicorn), `ray_app` (the same app in N replicas on Ray Serve). Needs the `[server]`
extras (fastapi, uvicorn, pydantic); `ray_app` the `[cluster]` extra (ray[serve]), imported only there."""
