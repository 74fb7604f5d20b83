"""The project's tools, above the library they use (staging and serving): `python -m tlaloc_jax.tools.demo` (what
`make demo` runs), `python -m tlaloc_jax.tools.train` (trains the embedded demo model) and
`python -m tlaloc_jax.tools.quality` (how far one served artifact is from another). Nothing in the library imports
them."""
