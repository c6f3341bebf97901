"""An independent oracle for the Gemma 3 270M conversion: next-token logits of our mlx-lm
directories against transformers' own GGUF loader and its PyTorch Gemma3 model (code this
package did not write: its own dequantization, tensor names and norm handling), on prompts shorter
and longer than the 512-token sliding window.

Two steps, two environments (torch is no dependency of dflash-mlx):

    # 1. a bench venv with the CPU torch wheel and transformers (never a CUDA torch)
    python3 -m venv /tmp/oracle && /tmp/oracle/bin/pip install --no-deps torch==2.13.0 \\
        && /tmp/oracle/bin/pip install filelock typing-extensions sympy networkx jinja2 fsspec transformers gguf numpy
    /tmp/oracle/bin/python bench/gemma3_oracle.py torch --ids ids.json --out torch.npz
    # 2. this repo's venv
    .venv/bin/python bench/gemma3_oracle.py compare --reference torch.npz --variants float32,bfloat16,q8,q4

`compare` writes the prompts' ids first when --ids does not exist (`ids` step), so the torch side
reads exactly the tokens ours does.
"""

import argparse
import json
import sys
from pathlib import Path

LENGTHS = (200, 2000)  # under, and four times over, the sliding window
POSITIONS = 48  # compared per prompt: the last ones, all past the window in the long prompt


def prompt_ids(tokenizer) -> dict:
    import sysconfig

    text = (Path(sysconfig.get_paths()["stdlib"]) / "difflib.py").read_text()
    prose = (Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py").read_text()[5000:40000]
    return {f"code-{n}": tokenizer.encode(text)[:n] for n in LENGTHS} | {
        f"prose-{n}": tokenizer.encode(prose)[:n] for n in LENGTHS
    }


def torch_side(ids_file: Path, out: Path, gguf: Path) -> None:
    # bench/kernels.py would shadow the `kernels` package transformers looks for
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
    import numpy as np
    import torch
    from transformers import Gemma3ForCausalLM

    torch.set_grad_enabled(False)
    model = Gemma3ForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    prompts = json.loads(ids_file.read_text())
    logits = {}
    for name, ids in prompts.items():
        out_logits = model(torch.tensor([ids])).logits[0, -POSITIONS:].float().numpy()
        logits[name] = out_logits.astype(np.float32)
        print(name, len(ids), "done", flush=True)
    np.savez(out, **logits)


def compare(reference: Path, ids_file: Path, variants: list[str]) -> None:
    import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    from dflash_mlx.convert.gemma3 import GEMMA3

    theirs = np.load(reference)
    prompts = json.loads(ids_file.read_text())
    print(
        "| variant | prompt | tokens | top-1 agreement | mean abs diff / mean abs logit | max abs diff | KL(theirs||ours) |"
    )
    print("|---|---|---|---|---|---|---|")
    for variant in variants:
        model, _ = mlx_lm.load(str(GEMMA3.path(variant)))
        for name, ids in prompts.items():
            hidden = model.model(mx.array([ids]))[:, -POSITIONS:]  # the 262k-row head only where compared
            ours = np.array(model.model.embed_tokens.as_linear(hidden)[0].astype(mx.float32))
            ref = theirs[name]
            p = _softmax(ref)
            kl = (p * (_log_softmax(ref) - _log_softmax(ours))).sum(-1).mean()
            print(
                f"| {variant} | {name} | {len(ids)} | {(ours.argmax(-1) == ref.argmax(-1)).mean():.3f} "
                f"| {np.abs(ours - ref).mean() / np.abs(ref).mean():.2e} | {np.abs(ours - ref).max():.3f} | {kl:.2e} |",
                flush=True,
            )


def _log_softmax(x):
    import numpy as np

    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _softmax(x):
    import numpy as np

    return np.exp(_log_softmax(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("ids", "torch", "compare"))
    parser.add_argument("--ids", type=Path, default=Path("gemma3_oracle_ids.json"))
    parser.add_argument("--out", type=Path, default=Path("gemma3_oracle_torch.npz"))
    parser.add_argument("--reference", type=Path, default=Path("gemma3_oracle_torch.npz"))
    parser.add_argument("--gguf", type=Path, help="the GGUF (torch step); default: dflash-mlx's cached copy")
    parser.add_argument("--variants", default="float32,bfloat16,q8,q4")
    args = parser.parse_args()
    if args.step == "torch":
        if args.gguf is None:
            sys.exit("error: the torch step needs --gguf PATH (dflash-mlx puts it in ~/.cache/dflash-mlx/gguf/)")
        torch_side(args.ids, args.out, args.gguf)
        return
    if args.step == "ids" or not args.ids.is_file():
        import dflash_mlx  # noqa: F401
        import mlx_lm

        from dflash_mlx.convert.gemma3 import GEMMA3

        _, tokenizer = mlx_lm.load(str(GEMMA3.path("float32")))
        args.ids.write_text(json.dumps(prompt_ids(tokenizer)))
        print(f"prompt ids in {args.ids}")
    if args.step == "compare":
        compare(args.reference, args.ids, args.variants.split(","))


if __name__ == "__main__":
    main()
