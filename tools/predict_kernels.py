"""The attention kernel each call of a training config would get on an sm90 GPU (H100, H200), predicted on this
machine: the config's model (its sizes, dropout and runtime.*) runs a training step, a validation pass, greedy and
beam search over a batch of Multi30k's lengths; every scaled_dot_product_attention call is recorded, and PyTorch
2.13's rules for sm90 say which kernel takes it (transformer/model/kernels/rules.py). About 30 s for the base model.

    python tools/predict_kernels.py                                     # the GPU recipe
    python tools/predict_kernels.py experiment=multi30k_de_en_gpu runtime.attention_backend=flash \\
        runtime.padding_free_attention=true
"""

import sys

from common.kernel_calls import predicted_kernels

if __name__ == "__main__":
    print(predicted_kernels(sys.argv[1:] or ["experiment=multi30k_de_en_gpu"]))
