"""Serving steerkit artifacts at scale: per-request steering inside stock vLLM.

* :mod:`.spec` -- the request's steering spec (artifacts from the store with a scale each, small
  inline operations), its validation, its prefix-cache salt, :func:`request_args` /
  :func:`request_body` to build requests, and :func:`resolve` (spec -> interventions, the one
  steering value: artifacts lower themselves exactly as ``SteerModel.steer`` lowers them).
* :mod:`.engine` -- one object per engine: :class:`~steerkit.serving.engine.EngineSteering` (a worker's
  hooks, its own steering operators, slots and requests' steerings), :class:`~steerkit.serving.engine.FrontEnd`
  (each request's spec checked once against the served model) and the request cache they share
  (:class:`~steerkit.serving.engine.RequestSteerings`: each spec resolved and compiled once).
* :mod:`.slots` -- :class:`~steerkit.serving.slots.StepSlots`, the persistent buffers the steering operators
  read (each request's tables in one fixed-capacity table, per-token slot indices, a device flag per site),
  written before each step, so compiled engines and CUDA graphs steer too.
* :mod:`.plan` -- the rows each request owns in a step (:func:`~steerkit.serving.plan.runner_requests`) and
  :class:`~steerkit.serving.plan.StepPlan`, a step steered on the host from each request's own programs
  (conditional steering, SAE latent clamps, steps larger than the slots).
* :mod:`.ops` -- :class:`~steerkit.serving.ops.ObjectOps`, graph operators that belong to one object.
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
