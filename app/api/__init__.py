"""The HTTP/WebSocket layer: the app factory, auth, CORS, guards, request plumbing, OpenAPI and the routes."""
