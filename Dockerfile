# The serving image: python:3.11-slim with the serving install (no JAX, no C compiler: the C kernels come prebuilt
# for each instruction-set level in the wheel, the loader picks one by the CPU's features), a non-root user, the
# artifact mounted read-only, and a HEALTHCHECK on /health, which answers 200 only once every entry is compiled.
#   docker build -t tlaloc-serve .
#   docker run -p 8000:8000 -v /path/to/artifact:/artifact:ro tlaloc-serve
# tests/runtime/test_native_variants.py reproduces its conditions (no compiler, CC unset, an empty kernel cache, a
# read-only artifact) and serves the default demo artifact.

# The wheel, built where a compiler is (setup.py compiles the kernels' variants into it).
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY tlaloc_jax tlaloc_jax
COPY export export
COPY serve serve
COPY kernels kernels
RUN pip wheel --no-deps --wheel-dir /wheels .

# The server: the project's own dependencies are the runtime's; the CPU plugin without the jax its metadata names.
FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/tlaloc_jax-*.whl \
    && pip install --no-cache-dir --no-deps lammps-jax-pjrt-cpu \
    && rm -rf /wheels \
    && useradd --create-home --uid 10001 tlaloc
USER tlaloc
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=900s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["python", "-m", "tlaloc_jax.serve", "/artifact", "--host", "0.0.0.0", "--port", "8000"]
