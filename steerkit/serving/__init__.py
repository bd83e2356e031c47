"""Serving steerkit artifacts at scale: per-request steering inside stock vLLM.

* :mod:`.spec` -- the request's steering spec (artifacts from the store with a scale each, small
  inline operations), its validation, its prefix-cache salt, :func:`request_args` /
  :func:`request_body` to build requests, and :func:`resolve` (spec -> interventions, the one
  steering value: artifacts lower themselves exactly as ``SteerModel.steer`` lowers them).
* :mod:`.plan` -- one engine step's plan: the step's steered requests compiled together by
  :func:`steerkit.interventions.compile` (cached across steps), per hooked site the rows of the
  flattened batch it steers, and :class:`~steerkit.serving.plan.StepSlots`, the persistent buffers
  (a fixed-capacity table and per-token slot indices) that the plan is written into before each step
  and that the steering operator (:mod:`steerkit.kernels.slots`) reads, so compiled engines steer too.
* :mod:`.capture` -- recording activations through vLLM: a request's record spec
  (``extra_args["steerkit_record"]``), the worker's per-step rows, :func:`record_generate`
  (outputs and each request's rows) and the data set of ``steerkit record --engine vllm``.
* :mod:`.vllm_plugin` -- the vLLM general plugin (entry point ``steerkit`` in
  ``vllm.general_plugins``; enable with ``VLLM_PLUGINS=steerkit STEERKIT_STORE=/path``).

In the serving process::

    from vllm import LLM, SamplingParams
    from steerkit.serving import request_args
    llm = LLM(model=model_dir)  # compiled (vLLM's default) or enforce_eager=True
    out = llm.generate(prompts, [SamplingParams(max_tokens=20, temperature=0, extra_args=request_args("happy@1")),
                                 SamplingParams(max_tokens=20, temperature=0)])

``steerkit serve MODEL_DIR --store STORE`` starts vLLM's OpenAI-compatible server with the plugin;
``steerkit model export --format hf DIR`` writes the default model as a folder vLLM loads.
"""
from steerkit.serving.capture import record_args, record_generate, start_llm
from steerkit.serving.spec import KEY, Spec, SpecError, parse_spec, request_args, request_body, resolve, salt

__all__ = ["KEY", "Spec", "SpecError", "parse_spec", "request_args", "request_body", "resolve", "salt",
           "record_args", "record_generate", "start_llm"]
