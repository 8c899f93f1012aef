"""mopd_jax: multi-teacher on-policy distillation in JAX/Flax."""
from setuptools import find_packages, setup

setup(
    name="mopd_jax",
    version="0.1.0",
    description="Multi-teacher on-policy distillation (Kimi K3 MOPD) in JAX/Flax",
    packages=find_packages(include=["mopd_jax", "mopd_jax.*", "experiments", "configs", "benchmarks"]),
    python_requires=">=3.10",
    # Lower bounds are the versions this project was tested with.
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "chex>=0.1.92",
        "ml_collections>=1.1.0",
        "tensorflow-datasets>=4.9.10",
        "array_record>=0.8.6",
        "absl-py>=2.5.1",
        "numpy>=2.0",
        "tqdm>=4.67",  # progress bars with ETA for every stage
        "tokenizers>=0.23.3",  # Hugging Face tokenizer.json adapter (mopd_jax.io.tokenizer)
        "safetensors>=0.8.0",  # Hugging Face checkpoints (mopd_jax.io.hf; the pipeline imports it)
        "matplotlib>=3.8",  # report plots
        "tensorboardX>=2.6.5",  # TensorBoard event files without TensorFlow
        "jinja2>=3.1",  # chat templates of Hugging Face tokenizers (sandboxed rendering)
        "math-verify>=0.9.0",  # the math verifier's answer equivalence (LaTeX, fractions, %)
        "pyarrow>=14",  # Parquet data files (mopd_jax.tasks.records); TFDS needs it too
        "grain>=0.2.18",  # record domains' loading: an index sampler sharded by JAX process
        "tornado>=6.4",  # the teacher server's asyncio HTTP server (mopd_jax.teachers.server)
    ],
    extras_require={
        "test": ["pytest>=9.0", "pytest-xdist>=3.8",  # -n 2: the suite on both cores
                 "torch==2.13.0", "transformers==5.24.0",
                 # tests/test_colabs.py executes the notebooks in a Jupyter kernel
                 "nbclient>=0.11.0", "nbformat>=5.11.1", "ipykernel>=7.4.0"],
    },
)
