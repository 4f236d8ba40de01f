"""compile="capture" (pyext.graphs): a denoiser replayed from captured graphs computes what plain
diffusers computes, after the calls, changes and moves a user makes.

On a CPU the CUDA graph is stood in for by a make_fx record of the forward, which bakes in what a
capture bakes in (the tensors it used by identity, every Python value it read, the control flow
taken) and replays on the captured inputs into the captured outputs; the GPU test at the end runs
real CUDA graphs.
"""
import copy
import importlib.util
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import pyext
from pyext import graphs
from pyext.offline import build_pipeline, run_example


class RecordedGraph:
    """A CPU stand-in for graphs.CudaGraph with the same contract."""

    device_type = "cpu"

    def __init__(self, fn, leaves, pool):
        self.leaves = leaves
        self.tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

        def flat(*tensors):
            inputs = list(leaves)
            for i, t in zip(self.tensors, tensors):
                inputs[i] = t
            return pytree.tree_leaves(fn(inputs))

        self.record = make_fx(flat)(*self._inputs())
        self.output = fn(leaves)
        # The tensors the record reads that are not inputs (the weights), and where they were: a
        # CUDA graph would read that memory whatever lives there now.
        self.weights = [(t, graphs.address(t)) for t in (getattr(self.record, n.target) for n in self.record.graph.nodes
                                                    if n.op == "get_attr")]

    @staticmethod
    def pool():
        return None

    def _inputs(self):
        return [self.leaves[i] for i in self.tensors]

    def replay(self):
        assert all(graphs.address(t) == a for t, a in self.weights), "replayed a graph whose weights moved"
        for dst, src in zip(pytree.tree_leaves(self.output), self.record(*self._inputs())):
            dst.copy_(src)
        return self.output


def capture_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "compile='capture'" in str(w.message)]


def unet_inputs(seed: int, size: int = 8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, size, size, generator=g), torch.tensor(500.0 + seed),
            torch.randn(2, 77, 32, generator=g))


def tiny_unet():
    return build_pipeline("sd15", "tiny").unet.eval()


def run(unet, seed: int, size: int = 8):
    sample, t, text = unet_inputs(seed, size)
    with torch.no_grad():
        return unet(sample, t, encoder_hidden_states=text, return_dict=False)[0]


def captured_pair():
    """A plain UNet and a copy of it with capture applied."""
    plain = tiny_unet()
    fast = copy.deepcopy(plain)
    graphs.apply_capture(fast, RecordedGraph)
    return plain, fast


def test_a_captured_pipeline_makes_plain_diffusers_images():
    """A 3-step generation: the first UNet call runs eagerly, the second captures, the third replays
    on that step's latents (a replay that skipped copying its inputs would denoise stale ones)."""
    plain = build_pipeline("sd15", "tiny")
    fast = build_pipeline("sd15", "tiny")
    captured = graphs.apply_capture(fast.unet, RecordedGraph)
    expected, got = run_example(plain, "sd15", steps=3), run_example(fast, "sd15", steps=3)
    assert (captured.eager_calls, captured.replays, len(captured.graphs)) == (1, 2, 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_replays_follow_new_inputs_and_hand_out_their_own_outputs():
    plain, fast = captured_pair()
    run(fast, 0), run(fast, 1)  # eager, then captured
    kept = run(fast, 2)
    kept_value = kept.clone()
    for seed in (3, 4):
        torch.testing.assert_close(run(fast, seed), run(plain, seed), atol=1e-5, rtol=0)
    assert torch.equal(kept, kept_value), "an output handed out earlier changed with a later replay"
    assert graphs.captured(fast).replays == 4  # the capturing call replays too


def test_a_replay_reads_no_values_on_the_host():
    from tests.test_host_reads import host_reads_trapped

    _, fast = captured_pair()
    run(fast, 0), run(fast, 1)  # eager, then captured
    with host_reads_trapped():
        run(fast, 2)
    assert graphs.captured(fast).replays == 2


def test_each_input_signature_gets_its_own_graph():
    plain, fast = captured_pair()
    for size in (8, 16, 8, 16, 8, 16):
        torch.testing.assert_close(run(fast, size, size), run(plain, size, size), atol=1e-5, rtol=0)
    assert len(graphs.captured(fast).graphs) == 2
    for seed in range(3):  # the same tensors passed another way: another structure, another graph
        sample, t, text = unet_inputs(seed)
        with torch.no_grad():
            out = fast(sample=sample, timestep=t, encoder_hidden_states=text, return_dict=True).sample
        torch.testing.assert_close(out, run(plain, seed), atol=1e-5, rtol=0)
    assert len(graphs.captured(fast).graphs) == 3 and graphs.captured(fast).replays == 6


def test_inference_mode_gets_its_own_graph():
    plain, fast = captured_pair()
    with torch.inference_mode():
        for seed in range(3):
            run(fast, seed)
    for seed in range(3, 6):  # under no_grad: the inference-mode graph's inputs cannot be written here
        torch.testing.assert_close(run(fast, seed), run(plain, seed), atol=1e-5, rtol=0)
    assert len(graphs.captured(fast).graphs) == 2


def test_the_captured_forward_has_the_models_signature():
    """Pipelines read the forward's parameters (diffusers' modular pipelines pass only those)."""
    import inspect

    plain, fast = captured_pair()
    assert inspect.signature(fast.forward) == inspect.signature(plain.forward)


def test_what_a_graph_cannot_follow_runs_eagerly():
    plain, fast = captured_pair()
    sample, t, text = unet_inputs(0)
    for _ in range(3):  # grad mode: no graph
        torch.testing.assert_close(fast(sample, t, text, return_dict=False)[0].detach(), run(plain, 0), atol=1e-5,
                                   rtol=0)
    with torch.no_grad():  # arguments that are neither tensors nor plain values (dicts and lists flatten)
        for value in ({1}, object()):  # unhashable; hashable by identity but changeable inside
            for _ in range(3):
                fast(sample, t, text, added_cond_kwargs={"unused": value}, return_dict=False)
    captured = graphs.captured(fast)
    assert not captured.graphs and captured.replays == 0 and captured.eager_calls == 9



def test_a_users_torch_compile_traces_the_eager_forward_once():
    """torch.compile over a captured model (optimize's default on CUDA) compiles the forward
    pyext captured, as often as plain diffusers' is compiled: the captured forward touches no
    state of its own while traced (a counter it bumped would be guarded on, and each call would
    compile again), and captures nothing inside the compile."""
    plain, fast = captured_pair()
    compiles = {}
    for name, model in (("plain", plain), ("captured", fast)):
        torch._dynamo.reset()
        graphs_made = compiles[name] = []

        def record(gm, inputs, made=graphs_made):
            made.append(gm)
            return gm.forward

        compiled = torch.compile(model, backend=record)
        for seed in range(4):
            torch.testing.assert_close(run(compiled, seed), run(plain, seed), atol=1e-5, rtol=0)
    torch._dynamo.reset()
    assert len(compiles["captured"]) == len(compiles["plain"]) == 1
    captured = graphs.captured(fast)
    assert (len(captured.graphs), captured.replays, captured.eager_calls) == (0, 0, 0)

@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")
def test_changing_adapters_after_capture_drops_the_stale_graphs():
    """A LoRA scale is a Python number the forward reads: a graph bakes it in. set_adapters and
    the other adapter methods drop the graphs, so the next calls capture the new scale."""
    from peft import LoraConfig

    plain, fast = captured_pair()
    for unet in (plain, fast):
        torch.manual_seed(0)
        unet.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_v"], init_lora_weights=False), "a")
    for seed in range(3):
        torch.testing.assert_close(run(fast, seed), run(plain, seed), atol=1e-5, rtol=0)
    for unet in (plain, fast):
        unet.set_adapters(["a"], weights=[0.25])
    assert not graphs.captured(fast).graphs
    for seed in range(3, 6):
        torch.testing.assert_close(run(fast, seed), run(plain, seed), atol=1e-5, rtol=0)
    assert graphs.captured(fast).replays >= 1
    for unet in (plain, fast):
        unet.disable_adapters()
    for seed in range(6, 9):
        torch.testing.assert_close(run(fast, seed), run(plain, seed), atol=1e-5, rtol=0)


@pytest.mark.parametrize("change", ["new submodule", "new parameter"])
def test_modules_and_parameters_assigned_after_capture_drop_the_graphs(change):
    """The captured objects stay alive (and so at their addresses): what changed is which ones the model holds."""
    plain, fast = captured_pair()
    for seed in range(3):
        run(fast, seed)
    torch.manual_seed(0)
    new = torch.nn.Conv2d(32, 4, 3, padding=1)
    for unet in (plain, fast):
        if change == "new submodule":
            unet.conv_out = copy.deepcopy(new)
        else:
            unet.conv_in.weight = torch.nn.Parameter(unet.conv_in.weight.detach() * 2)
    for seed in range(3, 6):
        torch.testing.assert_close(run(fast, seed), run(plain, seed), atol=1e-5, rtol=0)
    assert graphs.captured(fast).replays >= 1


def test_weights_moved_after_capture_drop_the_graphs():
    plain, fast = captured_pair()
    for seed in range(3):
        run(fast, seed)
    for unet in (plain, fast):  # new storage, as .to() or load_state_dict(assign=True) gives
        unet.conv_in.weight.data = unet.conv_in.weight.data * 2
    for seed in range(3, 6):
        torch.testing.assert_close(run(fast, seed), run(plain, seed), atol=1e-5, rtol=0)
    with torch.no_grad():  # in place: the same memory, which a replay reads as it is
        for unet in (plain, fast):
            unet.conv_out.bias.add_(1.0)
    torch.testing.assert_close(run(fast, 7), run(plain, 7), atol=1e-5, rtol=0)


def test_a_forward_that_cannot_be_captured_warns_once_and_runs_eagerly():
    class Refusing(RecordedGraph):
        def __init__(self, fn, leaves, pool):
            raise RuntimeError("operation not permitted when stream is capturing")

    plain = tiny_unet()
    fast = copy.deepcopy(plain)
    graphs.apply_capture(fast, Refusing)
    with pytest.warns(UserWarning, match="UNet2DConditionModel runs eagerly.*operation not permitted"):
        for seed in range(2):
            torch.testing.assert_close(run(fast, seed), run(plain, seed), atol=1e-5, rtol=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(run(fast, 2), run(plain, 2), atol=1e-5, rtol=0)
    assert not capture_warnings(caught) and graphs.captured(fast).eager_calls == 3


def test_remove_gives_back_the_forward_and_methods_it_found():
    unet = tiny_unet()
    before = {"fuse_lora": lambda *a, **k: "another wrapper"}
    unet.__dict__.update(before)
    graphs.apply_capture(unet, RecordedGraph)
    assert isinstance(unet.forward, graphs.Captured) and unet.fuse_lora is not before["fuse_lora"]
    graphs.remove_capture(unet)
    assert "forward" not in unet.__dict__ and "set_adapters" not in unet.__dict__
    assert unet.__dict__["fuse_lora"] is before["fuse_lora"] and graphs.captured(unet) is None


def test_a_captured_model_pickles_without_its_graphs(tmp_path):
    plain, fast = captured_pair()
    for seed in range(3):
        run(fast, seed)
    torch.save(fast, tmp_path / "unet.pt")
    loaded = torch.load(tmp_path / "unet.pt", weights_only=False)
    assert graphs.captured(loaded).model is loaded and not graphs.captured(loaded).graphs
    for seed in range(3, 6):
        torch.testing.assert_close(run(loaded, seed), run(plain, seed), atol=1e-5, rtol=0)
    assert graphs.captured(loaded).replays == 2


def test_a_forward_kept_elsewhere_runs_eagerly_once_removed():
    """An offload hook added after capture keeps the forward it wrapped; after remove_capture that
    forward no longer drops graphs on changes, so it replays none."""
    plain, fast = captured_pair()
    kept = fast.forward
    for seed in range(3):
        run(fast, seed)
    graphs.remove_capture(fast)
    for seed in range(3, 6):
        sample, t, text = unet_inputs(seed)
        with torch.no_grad():
            out = kept(sample, t, encoder_hidden_states=text, return_dict=False)[0]
        torch.testing.assert_close(out, run(plain, seed), atol=1e-5, rtol=0)
    assert kept.replays == 2 and not kept.graphs


def test_a_deep_copy_captures_on_its_own():
    plain, fast = captured_pair()
    for seed in range(3):
        run(fast, seed)
    twin = copy.deepcopy(fast)
    assert graphs.captured(twin).model is twin and not graphs.captured(twin).graphs
    with torch.no_grad():
        twin.conv_out.bias.add_(1.0)
        plain.conv_out.bias.add_(1.0)
    for seed in range(3, 6):
        torch.testing.assert_close(run(twin, seed), run(plain, seed), atol=1e-5, rtol=0)
    assert graphs.captured(fast).model is fast


def test_capture_on_a_cpu_pipeline_is_skipped_with_the_reason():
    pipe = pyext.optimize(build_pipeline("sd15", "tiny"), compile="capture", dtype="keep", fp8="off")
    entry = next(e for e in pyext.report(pipe).entries if e.technique == "compile")
    assert entry.status == "skipped" and "CUDA graphs" in entry.detail and "compile='compile'" in entry.detail
    assert graphs.captured(pipe.unet) is None


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["sd15", "flux"])
def test_captured_pipelines_on_a_gpu_make_the_eager_images(arch):
    """Real CUDA graphs: optimize's default on CUDA captures; its images are the eager ones."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    eager = pyext.optimize(build_pipeline(arch, "tiny", dtype=torch.bfloat16, device="cuda"), compile="off")
    fast = pyext.optimize(build_pipeline(arch, "tiny", dtype=torch.bfloat16, device="cuda"))
    denoiser = fast.unet if arch == "sd15" else fast.transformer
    captured = graphs.captured(denoiser)
    assert captured is not None, pyext.report(fast)
    stream = torch.cuda.current_stream()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # One UNet call per step (guidance batched): eager, captured, then replays. Resolutions in
        # turn: graphs in one pool replayed in any order.
        for size, replays in ((64, 3), (96, 6), (64, 10), (96, 14)):
            got = run_example(fast, arch, steps=4, height=size, width=size)
            assert captured.replays == replays, (size, captured.replays, captured.eager_calls)
            torch.testing.assert_close(got, run_example(eager, arch, steps=4, height=size, width=size), atol=2e-3,
                                       rtol=0)
    assert not capture_warnings(caught) and not captured.failures and len(captured.graphs) == 2
    assert torch.cuda.current_stream() == stream
    calls = []
    handle = denoiser.register_forward_pre_hook(lambda m, a, kw: calls.append((a, kw)), with_kwargs=True)
    run_example(fast, arch, steps=1)
    handle.remove()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a replay waits for nothing on the host
    try:
        with torch.no_grad():
            for _ in range(3):
                denoiser(*calls[0][0], **calls[0][1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert captured.replays == 18  # 14, one in the 1-step run, three here
