import torch
from torch import nn

import slimact


def _toy(policy=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    if policy is not None:
        slimact.convert(model, policy)
    return model


X = torch.randn(2, 3, 16)


def test_two_linear_toy_plain_matches_hand_count():
    report = slimact.profile(_toy(), X)
    # Linear 0 keeps its input x [2, 3, 16] fp32; Linear 1 keeps h [2, 3, 32] fp32. Weights are parameters.
    assert report.by_module == {"0": 2 * 3 * 16 * 4, "1": 2 * 3 * 32 * 4}
    assert report.activation_bytes == 384 + 768
    assert report.by_kind == {"linear": 1152}


def test_two_linear_toy_converted_matches_hand_count():
    report = slimact.profile(_toy("int8"), X)
    # uint8 codes of the same tensors, plus fp32 lo and step for 8 channel groups each.
    assert report.by_module == {"0": 2 * 3 * 16 + 2 * 8 * 4, "1": 2 * 3 * 32 + 2 * 8 * 4}
    assert report.activation_bytes == 160 + 256


def test_unique_storages_counted_once_and_params_excluded():
    class Square(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return (x * x).sum() + (self.w * x).sum()  # x saved three times; w saved (excluded)

    report = slimact.profile(Square(), torch.randn(10, 4, requires_grad=True))
    assert report.activation_bytes == 10 * 4 * 4


def test_profile_leaves_the_model_as_found():
    model = _toy("mesa").eval()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    torch.manual_seed(3)
    expected_next = torch.rand(3)
    torch.manual_seed(3)
    slimact.profile(model, X)
    assert torch.equal(torch.rand(3), expected_next)  # RNG state untouched
    assert not model.training and not model[0].training
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[1].bias.grad is None
    assert "_slimact_x_lo" not in model[0]._buffers  # no running estimate was created or advanced


def test_loss_fn_and_tuple_inputs_and_tables():
    model = _toy()
    report = slimact.profile(model, (X,), loss_fn=lambda y: y.pow(2).mean())
    # pow saves its input: the output of Linear 1, [2, 3, 8] fp32, charged to the loss.
    assert report.by_module["(loss)"] == 2 * 3 * 8 * 4
    table = report.table(by="module")
    assert "(loss)" in table and "total" in table
    conv = slimact.profile(_toy("int8"), X)
    text = slimact.profile(_toy(), X).compare(conv)
    assert "linear" in text and "0.361x" in text  # 416 / 1152


def test_a_tensor_three_linears_keep_is_packed_once():
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.q(x) * self.k(x) + self.v(x)

    x = torch.randn(2, 5, 16)
    plain = slimact.profile(QKV(), x)
    conv = slimact.profile(slimact.convert(QKV()), x)
    # Plain PyTorch keeps x once (one storage); slimact keeps one 8-bit copy for all three, charged to q.
    assert plain.by_kind["linear"] == 2 * 5 * 16 * 4
    assert conv.by_module["q"] == 2 * 5 * 16 + 2 * 8 * 4
    assert "k" not in conv.by_module and "v" not in conv.by_module
