# One image for every service (gateway, workers); the command picks the role.
# A *devel* CUDA base: Triton compiles its kernel launchers at run time with the C compiler and the Python
# headers, which runtime images lack. CUDA 13.0 matches torch 2.13.0's PyPI wheel (cuda-toolkit 13.0.3).
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# Requirements first, in their own layer: a source edit does not re-download torch. The pins are
# pyproject's runtime dependencies plus the `pd` extra (tests/test_packaging.py keeps them equal). torch from
# PyPI is the CUDA 13 build and brings its triton (3.7.1).
RUN pip install \
        torch==2.13.0 numpy==2.4.6 aiohttp==3.14.5 msgspec==0.23.0 safetensors==0.8.0 tokenizers==0.23.3 \
        jinja2==3.1.6 prometheus-client==0.26.0 redis==8.1.0 huggingface-hub==2.4.0 xgrammar==0.2.9 \
        regex==2026.5.9 tqdm==4.70.1 transformers==5.24.0 pyyaml==6.0.3 uvloop==0.23.0 orjson==3.13.0 \
    && pip install ucxx-cu13==0.52.0

# Then the source; its dependencies are all installed above.
COPY pyproject.toml README.md ./
COPY services ./services
COPY shared ./shared
COPY kernels ./kernels
COPY lang_client ./lang_client
RUN pip install --no-deps -e .

EXPOSE 30000
CMD ["python", "-m", "services.launch", "--model-path", "tiny-random", "--host", "0.0.0.0", "--port", "30000"]
