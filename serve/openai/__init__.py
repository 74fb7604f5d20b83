"""The OpenAI-compatible HTTP server (FastAPI; JAX-free), one job a module: body.py (the JSON body), checks.py and
protocol.py (the request models and their field checks), generation.py (a request's sequences), server.py (the
routes' work: auth, sampling, admission), responses.py (answers and streams in OpenAI's shapes), app.py
(create_app: routes, middleware, lifespan). serve/http.py re-exports create_app."""
