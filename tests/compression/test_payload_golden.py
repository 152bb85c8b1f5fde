"""Golden payload bytes: every codec, fixed seeds, fixed inputs -> the sha256 of its payloads.

The hashes are hard-coded here (making a codec faster must not change its output), so any change
of a single payload byte (wire format, rounding, selection, tie-breaking, random stream) fails.
Each case compresses twice with one codec instance, so a changed random stream on the second call
(a generator consumed differently) fails as well. The decoded tensors are pinned the same way.

Torch's float reductions (sign's mean |x|, ATOMO's SVD) round differently with another number of
intra-op threads (1 thread against 2+ changes sign's scale in its last bit here, on main as well), so
the hashes are pinned with 2 torch threads, the count they were computed with.

PowerSGD's QR and ATOMO's SVD of a matrix run in the CPU's LAPACK kernels, whose last bits (and the
sign of a singular vector) differ between CPU models and BLAS builds. For those cases
(``LAPACK_CASES``) the hash covers what the codec decides (headers, payload lengths, the second call
consuming the random stream), and a separate test bounds the decoded values' relative error against
the value computed with the hashes.

Regenerate (only for an intended, announced wire change): ``python tests/compression/test_payload_golden.py``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import fedcomp.compression as fc
from fedcomp.compression.wire import parse_header


def _normal(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def _inputs() -> dict[str, torch.Tensor]:
    """Fixed inputs from numpy's PCG64 stream (stable across releases)."""
    heavy = _normal(5, 300_000)
    heavy[::997] *= 40.0  # a few large entries, as in real updates
    return {
        "f32_2d": torch.from_numpy(_normal(1, 1000)).reshape(20, 50),
        "f16": torch.from_numpy(_normal(2, 777)).to(torch.float16),
        "bf16": torch.from_numpy(_normal(3, 513)).to(torch.bfloat16),
        "f64": torch.from_numpy(_normal(4, 300).astype(np.float64)),
        "zero_d": torch.tensor(0.37),
        "zeros": torch.zeros(129),
        "f32_100k": torch.from_numpy(_normal(6, 100_000)),
        "f32_300k": torch.from_numpy(heavy),
        # fp16-rounded values: many ties at the k-th magnitude (top-k tie-breaking is pinned)
        "ties_300k": torch.from_numpy(_normal(7, 300_000)).to(torch.float16).to(torch.float32),
    }


CODECS: dict[str, tuple[str, dict]] = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "sign": ("sign", {}),
    "int8": ("int8", {"seed": 0}),
    "int8_b100": ("int8", {"block_size": 100, "seed": 1}),
    "qsgd": ("qsgd", {"seed": 0}),
    "qsgd_exp7": ("qsgd", {"levels": 7, "spacing": "exponential", "seed": 0}),
    "qsgd_l3_b100": ("qsgd", {"levels": 3, "bucket_size": 100, "seed": 2}),
    "qsgd_l300": ("qsgd", {"levels": 300, "seed": 3}),
    "eden": ("eden", {"seed": 0}),
    "eden_unbiased": ("eden", {"unbiased": True, "seed": 1}),
    "stc": ("stc", {"density": 0.01}),
    "stc_400": ("stc", {"density": 0.0025}),
    "topk": ("topk", {"density": 0.01}),
    "topk_fp16": ("topk", {"density": 0.001, "value_dtype": "fp16"}),
    "topk_dense": ("topk", {"density": 0.3}),
    "randomk": ("randomk", {"density": 0.01, "seed": 0}),
    "randomk_dense": ("randomk", {"density": 0.5, "rescale": True, "seed": 1}),
    "powersgd": ("powersgd", {"rank": 2, "seed": 0}),
    "atomo": ("atomo", {"seed": 0}),
}


#: Cases whose float bytes come from a LAPACK factorisation (QR, SVD): the hash covers the structure.
LAPACK_CASES = frozenset({"atomo/f32_2d", "powersgd/f32_2d"})

#: Relative L2 error of the decoded first payload of each LAPACK case (CPU-independent to ~1e-6).
LAPACK_ERRORS = {"atomo/f32_2d": 3.318129579195999, "powersgd/f32_2d": 0.933086183499484}


def _digest(name: str, params: dict, x: torch.Tensor, structure_only: bool = False) -> str:
    """sha256 over both payloads of two calls, and the decoded first payload; or the error type.

    With ``structure_only`` the hash covers each payload's header and length, not its float body.
    """
    c = fc.get_compressor(name, **params)
    h = hashlib.sha256()
    try:
        first = c.compress(x)
        second = c.compress(x)
    except ValueError as exc:
        return f"error:{type(exc).__name__}"
    for p in (first, second):
        h.update(len(p).to_bytes(8, "little"))
        h.update(p[:parse_header(p).body_offset] if structure_only else p)
    if not structure_only:
        h.update(fc.decompress(first).numpy().tobytes())
    return h.hexdigest()[:32]


def _relative_error(name: str, params: dict, x: torch.Tensor) -> float:
    """||decompress(compress(x)) - x|| / ||x|| of a fresh codec's first call, in float64."""
    y = fc.decompress(fc.get_compressor(name, **params).compress(x)).double()
    return float(torch.linalg.vector_norm(y - x.double()) / torch.linalg.vector_norm(x.double()))


GOLDEN: dict[str, str] = {  # case -> sha256[:32] of its payloads and decoded tensors (see _digest)
    'none/f32_2d': 'ee1e78bed567d94116969d3084ba7822',
    'none/f16': '12204a67401269ce053ce0b1a35d53dc',
    'none/bf16': 'b70e14f3d1650ce8560a29bcb7438d31',
    'none/f64': 'ca6300707e8d7f7021e9a30e7e7179c8',
    'none/zero_d': 'c73debd94ad83a7d8237dcf8adc8e8fa',
    'none/zeros': 'd983ecf9cec17722177078c7d6cb9f99',
    'none/f32_100k': 'f724685cf6a3892083856239d82bd544',
    'none/f32_300k': 'd77a3096efb442806912c995e9dfd099',
    'none/ties_300k': '963dec4867a2cbea3f17b6e043b4b9fb',
    'fp16/f32_2d': 'e772fd603df4da2b67714efdf0fdb167',
    'fp16/f16': '2bfc30489a8eca9bffc48ce49b996b9b',
    'fp16/bf16': 'fa913636d019d458131ea4e87099ac34',
    'fp16/f64': '1a2b6de800882ad87024aa4f9e9c7003',
    'fp16/zero_d': 'b25a7a640fc296db67699ad3b0e8e288',
    'fp16/zeros': '05ca5db27473ecf0ba81961c69feeeb0',
    'fp16/f32_100k': 'fb0543df3514595f2f13fcc0413c26bd',
    'fp16/f32_300k': '7f1316434843529fd912ba7ee54ca28a',
    'fp16/ties_300k': 'f99a1bcb6ddebe2aa3a80217b77589ce',
    'bf16/f32_2d': '7d5b7db9c271af32c2dbeb147dd98f39',
    'bf16/f16': '46d63a879a6d32100e6681e01bf19a75',
    'bf16/bf16': '25c3f296ec72618688b8643dc13f7bfe',
    'bf16/f64': 'bc78f3c5b211e685ca2fda595a80eb10',
    'bf16/zero_d': '6b1f0b847f52055d63da6a3ec3139b96',
    'bf16/zeros': '93b6eee3368959222b5366c39bd4ba7e',
    'bf16/f32_100k': 'c37b01231f116a2fea0dc2455a0b7e8a',
    'bf16/f32_300k': 'a29fe3851d9be7a538af39895da9fd79',
    'bf16/ties_300k': '245517692e7e84062d0f55f7e0cf02a6',
    'sign/f32_2d': '8d302b5671d4899aa30884b308446de3',
    'sign/f16': '88a9a1170c7c681e3f1895c81f197ae0',
    'sign/bf16': 'c6242a5a20e4151dd52467b427969cd5',
    'sign/f64': '2073502e4c608942085930a06c9ce653',
    'sign/zero_d': '3edf589b539fb09569d83f6738b8d463',
    'sign/zeros': 'fd44a33440301a312e261774ccbd401f',
    'sign/f32_100k': 'c532e990f0cbbacf738b9ecd666c6602',
    'sign/f32_300k': '2b22df461e9983eb9335d42bda4f888d',
    'sign/ties_300k': '0f1e2b6051fde7ff5c60a4ef506976aa',
    'int8/f32_2d': '1e92e0206964e0c38afdb713403e8fa7',
    'int8/f16': '4a046851004d29c6ecbf1409be2e2f39',
    'int8/bf16': '9612a14a157724612181cd4e2fed2431',
    'int8/f64': 'd239d1cb350609eb05f172dd671a873f',
    'int8/zero_d': 'c8b29414cb4938a3956c5a7e2c3080af',
    'int8/zeros': 'bc80455a2f4efec5d0cec8f5de44eab4',
    'int8/f32_100k': 'e936fbd92ba2a6980d931e8d32fea9bd',
    'int8/f32_300k': '37866dcde9447e5e6681ec6e3f453eb5',
    'int8/ties_300k': 'f9de8b68131c1e72d1895755ac0ac665',
    'int8_b100/f32_2d': '0c3b03d006fc7675b6197018e53a6f03',
    'int8_b100/f16': '7129edae6cc8d136c4f638dfca66f90a',
    'int8_b100/bf16': '9f8d9e89d91f06febd05e37896fa55bc',
    'int8_b100/f64': '87ec2bb54f5f8452bb5ded72bdfac758',
    'int8_b100/zero_d': '7aba0da9cb2137307c71e045b8eae96f',
    'int8_b100/zeros': 'b77ce2bf9b99d31d471737dfcfe1b8e8',
    'int8_b100/f32_100k': '031bef6bd8ffffcf2658e7cd3abcf496',
    'int8_b100/f32_300k': '4e357b2a00bfaa0b06455c9f4237428a',
    'int8_b100/ties_300k': 'bd5a8b5e4885a08a34f8396d29f9d3a7',
    'qsgd/f32_2d': '8390bd004d423d35d8c0e9006dbe64ba',
    'qsgd/f16': 'f7c3233799fd292c0490f2031f17287d',
    'qsgd/bf16': 'd6d84838d5fa529e6ccc44d7073129dd',
    'qsgd/f64': '47630306accc106b3730d17ce85e8e08',
    'qsgd/zero_d': '12d9a2b4b62c997b09889e81f0703329',
    'qsgd/zeros': '07f13c549a0c4c3a8e71b6a6aa858d58',
    'qsgd/f32_100k': '81a93d0efbd6fb76513dcb445213b21d',
    'qsgd/f32_300k': '5b3beeff19679f493206cf69c26df9a6',
    'qsgd/ties_300k': 'be21e0b3bca7ee5c8b9751ad26ca7d4a',
    'qsgd_exp7/f32_2d': '9ae2d394894a2fb053eaa4b7c0b651a3',
    'qsgd_exp7/f16': '1548ab1fd0963ea6fd285b114f095b5b',
    'qsgd_exp7/bf16': '893306178b68d0bbe8d4ffa05eb3c8fc',
    'qsgd_exp7/f64': '18363d9331ec46d046437ff07abe8474',
    'qsgd_exp7/zero_d': 'e8ed843a3da78fe8edb1978324a26249',
    'qsgd_exp7/zeros': 'e6bc1e9eb81059b195f3fab9ef961499',
    'qsgd_exp7/f32_100k': 'f50e5f925182fd70d1ccb5d313a57538',
    'qsgd_exp7/f32_300k': 'bb9526224fd3b29e960c8eb3e61813e3',
    'qsgd_exp7/ties_300k': 'e3c0cefd59a07b57f3688f7078b1725a',
    'qsgd_l3_b100/f32_2d': '630c46967923f19069c3a525051ec05f',
    'qsgd_l3_b100/f16': '5e1e3941ea3910f91dc098f25bb295b6',
    'qsgd_l3_b100/bf16': '5fd47b1bde399bd92f4cb0a76b37afd1',
    'qsgd_l3_b100/f64': 'd0b38cb23e08001c7dd7833958678b04',
    'qsgd_l3_b100/zero_d': '1f8c025fee47e34e78d1d51631fca89e',
    'qsgd_l3_b100/zeros': 'fa51f528aa95b3c40154f58f8288280b',
    'qsgd_l3_b100/f32_100k': 'e3b27912f4e16e3a947ddf43fb67a6ab',
    'qsgd_l3_b100/f32_300k': 'bb0d0fc0b634233a2bac223894d078de',
    'qsgd_l3_b100/ties_300k': 'f9e96d85d2a2bb24bc156699ed27ea1b',
    'qsgd_l300/f32_2d': '925bd611485a827a854849d64a10e142',
    'qsgd_l300/f16': '414f9ee5c1d57804b55ab56776d3302a',
    'qsgd_l300/bf16': '1845d8cd43a99d51a595b60e738ff2d6',
    'qsgd_l300/f64': '1c13d22a75960e5a1a01cadf87271d64',
    'qsgd_l300/zero_d': '7e9bda74258251e021f95b9358d48ec7',
    'qsgd_l300/zeros': 'c159ad0d1ff9a37e03b715158db233d4',
    'qsgd_l300/f32_100k': '5c8ce0db9e6f5f2168638f9f17e71545',
    'qsgd_l300/f32_300k': 'fa215f1c72835cddd3fd4f48457ba2da',
    'qsgd_l300/ties_300k': '5835c0482800949cbe0457d0c597b0cb',
    'eden/f32_2d': 'a14b0a680d7c2549c19c3b522715f869',
    'eden/f16': '4f85ac2aa136892ab2c27900b64e2c91',
    'eden/bf16': 'f26418a5f0c1e8228fba2c8a4618181f',
    'eden/f64': '1491c4470e6e15b362c3aa7ced3dd8e6',
    'eden/zero_d': '7c3733fc30973c8e490a78146893b198',
    'eden/zeros': '7e176436fe56ccde441dab0f22936b81',
    'eden/f32_100k': '0a58d4a5f7cf18f8a88153d1a5ce243e',
    'eden/f32_300k': '458346c684ddde2bdfd29bde85c8ca2c',
    'eden/ties_300k': '2cec9f7b4cc3ff990c975281a2f3a1ac',
    'eden_unbiased/f32_2d': 'e791b4851d846a9078202084651c06a8',
    'eden_unbiased/f16': '1ae0ddf37e8cad5b92cb3bfcba4a1a23',
    'eden_unbiased/bf16': 'b26feecc78197e462c18fed6f6f198fd',
    'eden_unbiased/f64': 'db8ba43107ad2148af690abd52ce91a2',
    'eden_unbiased/zero_d': 'b49bf835296ab25ef2df74ce5aa1f349',
    'eden_unbiased/zeros': '213e187a349f4ef76ec3b361e343eb1e',
    'eden_unbiased/f32_100k': '99276d0a64e975bf1f2391df24bcfd34',
    'eden_unbiased/f32_300k': '4d1d788675a746df4aae9667e3b9341d',
    'eden_unbiased/ties_300k': '82e51e7ee8cbf500731ef662c4982d50',
    'stc/f32_2d': 'a8156b6f2002a913952981da33796a53',
    'stc/f16': '2eefe8d0ce54d61e9b7ce8c4b8232290',
    'stc/bf16': '0750af90e9152cdf39d3bee7097b22b2',
    'stc/f64': '72c1a41f7dc4df08c577ce15329be1cc',
    'stc/zero_d': 'c2d30784a232be732e3f49cd696eae5e',
    'stc/zeros': '6072494c0fe3449334a3741ef51ed154',
    'stc/f32_100k': '4f029ac8ba97937755b7e1e74cf2da8e',
    'stc/f32_300k': 'db445392f00498438c8bd4f652a2c67a',
    'stc/ties_300k': 'ef83b90f4ecddb796eadf79a70769c51',
    'stc_400/f32_2d': '5f7882ae3f9f63f8b630aa8a723a194d',
    'stc_400/f16': 'c0b5018ed6fd9f8d1aca0cbb46d2c174',
    'stc_400/bf16': '882497db95f35194da792c8555a623a8',
    'stc_400/f64': 'b26c95e7005185416c021e71b04790ab',
    'stc_400/zero_d': 'c2d30784a232be732e3f49cd696eae5e',
    'stc_400/zeros': '6072494c0fe3449334a3741ef51ed154',
    'stc_400/f32_100k': '8b766320d7bf35dd736a4885285d8676',
    'stc_400/f32_300k': 'c221b1f860261d9404f14cfe34579cab',
    'stc_400/ties_300k': 'e4d9b7ad6b383f96a178ba53f20f37a2',
    'topk/f32_2d': 'cc7aa7d469558b140ab0a316b4d2036f',
    'topk/f16': '0ed45c2c5a7ac2b095b68a06fbaae9b0',
    'topk/bf16': '2b00d999abaaa682597c466d6e0bbab0',
    'topk/f64': '29aa77e1a42b6edc00cf2fb914112def',
    'topk/zero_d': '9f8d2d58e0ca33278f12f11aa3d30a64',
    'topk/zeros': '1fce4351f8aa1c0a4d74e9a4eb824d58',
    'topk/f32_100k': '1a6f2afe0cf243c89730f8b1a21c1d69',
    'topk/f32_300k': 'c4f2d58d9178a132c13137722c024384',
    'topk/ties_300k': 'd03ba441c7c1ce81c09d85e857ee6550',
    'topk_fp16/f32_2d': '0c1b16cf3d0cb6cd44f8cb0a7bd0f5c3',
    'topk_fp16/f16': 'c8650c35221fcaa06ccc5a015bad4550',
    'topk_fp16/bf16': '1575595b44f005108dbdc6950335447c',
    'topk_fp16/f64': '0f67697cf272f4ce949df9a622246bcf',
    'topk_fp16/zero_d': 'bcdaa9ed75e1d7d41919330dba88aeec',
    'topk_fp16/zeros': '39e3a84ca1d9a4fed4def6c4f4144627',
    'topk_fp16/f32_100k': '2e5fb99be2aa353588d6d89925ed1b6f',
    'topk_fp16/f32_300k': 'f63137d25d940f94cce4a2c9ae65b54e',
    'topk_fp16/ties_300k': '086e9ca4fff5f877b7271405f792b815',
    'topk_dense/f32_2d': '4514e3b2ea309ef98e7e8200cef521b5',
    'topk_dense/f16': '3410e0a95af001f9a26bfcad81be0959',
    'topk_dense/bf16': '2a89e30f942d795339659e2c28a2c355',
    'topk_dense/f64': '4bd9b92c3026a20eb580bab7ba8559cf',
    'topk_dense/zero_d': '9f8d2d58e0ca33278f12f11aa3d30a64',
    'topk_dense/zeros': '7ace44c89d3a3f18dc9ac5798e791559',
    'topk_dense/f32_100k': '4cc4f195c5a7c72a35ab97a50c40e87b',
    'topk_dense/f32_300k': 'aff4d06cbda8e217653391f1aee46b7d',
    'topk_dense/ties_300k': '64338cb72a16d537c1eb6271f91ad34a',
    'randomk/f32_2d': 'a81031803b07f700ca8f44561e5f4bff',
    'randomk/f16': '91f65f109b294957d8bfb0c0b52521a6',
    'randomk/bf16': '1df8f11ce0d9c09e445cac1a4c7e1983',
    'randomk/f64': '3936ea5e5d35c3126ab8f39e4b999d08',
    'randomk/zero_d': '7f1d575bc1bde7a816f3e0573e997c0f',
    'randomk/zeros': 'cd78b99795b5708de4d0abdf90149f25',
    'randomk/f32_100k': '4c4aac7fa881f2ad6e3bfdc99b317fcf',
    'randomk/f32_300k': 'b73ea210377db7869eda9615cdd34040',
    'randomk/ties_300k': '9f9378fd1d752dae9dc666893bd170b4',
    'randomk_dense/f32_2d': '72b28ebe80fe5a55ce84c64f6583d59f',
    'randomk_dense/f16': '8cf846d4a8e811d9370282d0c80138b5',
    'randomk_dense/bf16': '5eb0ecb9863935f0107b8003dbaaf5dd',
    'randomk_dense/f64': 'a3ac5b0c073ba7984ecba84952759d56',
    'randomk_dense/zero_d': '45851cc3ef6e9156749b34ad1075a8f6',
    'randomk_dense/zeros': 'fcc0ea769904260aac87ec25fea6d0f2',
    'randomk_dense/f32_100k': 'b71e1363e081b33c65c6ae6e604c34ad',
    'randomk_dense/f32_300k': 'b2e80252ff8f1e274a2ec597f8504f19',
    'randomk_dense/ties_300k': '0749332c07dac3c39ae3594dcb80a295',
    'powersgd/f32_2d': '7ae33be13cdaa91163be14a493727c2d',
    'powersgd/f16': '12204a67401269ce053ce0b1a35d53dc',
    'powersgd/bf16': 'b70e14f3d1650ce8560a29bcb7438d31',
    'powersgd/f64': 'ca6300707e8d7f7021e9a30e7e7179c8',
    'powersgd/zero_d': 'c73debd94ad83a7d8237dcf8adc8e8fa',
    'powersgd/zeros': 'd983ecf9cec17722177078c7d6cb9f99',
    'powersgd/f32_100k': 'f724685cf6a3892083856239d82bd544',
    'powersgd/f32_300k': 'd77a3096efb442806912c995e9dfd099',
    'powersgd/ties_300k': '963dec4867a2cbea3f17b6e043b4b9fb',
    'atomo/f32_2d': 'c43074a106891f584110d9ee7be0926a',
    'atomo/f16': '12204a67401269ce053ce0b1a35d53dc',
    'atomo/bf16': 'b70e14f3d1650ce8560a29bcb7438d31',
    'atomo/f64': 'ca6300707e8d7f7021e9a30e7e7179c8',
    'atomo/zero_d': 'c73debd94ad83a7d8237dcf8adc8e8fa',
    'atomo/zeros': 'd983ecf9cec17722177078c7d6cb9f99',
    'atomo/f32_100k': 'f724685cf6a3892083856239d82bd544',
    'atomo/f32_300k': 'd77a3096efb442806912c995e9dfd099',
    'atomo/ties_300k': '963dec4867a2cbea3f17b6e043b4b9fb',
}


def _compute() -> dict[str, str]:
    xs = _inputs()
    return {f"{case}/{inp}": _digest(name, params, x, f"{case}/{inp}" in LAPACK_CASES)
            for case, (name, params) in CODECS.items() for inp, x in xs.items()}


#: Torch intra-op threads the hashes were computed with.
THREADS = 2


@pytest.fixture
def pinned_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", sorted(CODECS))
def test_payload_bytes_unchanged(case: str, pinned_threads) -> None:
    """Every payload byte (and every decoded value) of ``case`` equals what main produced."""
    name, params = CODECS[case]
    xs = _inputs()
    got = {f"{case}/{inp}": _digest(name, params, x, f"{case}/{inp}" in LAPACK_CASES) for inp, x in xs.items()}
    want = {k: v for k, v in GOLDEN.items() if k.startswith(case + "/")}
    assert len(want) == len(xs)
    assert got == want


@pytest.mark.parametrize("key", sorted(LAPACK_CASES))
def test_factorising_codecs_decode_as_computed(key: str, pinned_threads) -> None:
    """The decoded values of a QR/SVD case have the relative error they had when the hashes were made."""
    case, inp = key.split("/")
    name, params = CODECS[case]
    assert _relative_error(name, params, _inputs()[inp]) == pytest.approx(LAPACK_ERRORS[key], rel=1e-4)


if __name__ == "__main__":
    torch.set_num_threads(THREADS)
    for key, value in _compute().items():
        print(f"    {key!r}: {value!r},")
    xs = _inputs()
    for key in sorted(LAPACK_CASES):
        case, inp = key.split("/")
        print(f"    {key!r}: {_relative_error(*CODECS[case], xs[inp])!r},")
