"""The engine's HTTP server: OpenAI-compatible API, /health, /metrics, admin API under /kvtune/v1/."""
