// SPDX-License-Identifier: Apache-2.0
// llama.cpp's logits for benchmarks/llama_cpp_logits.py (--runner c), without Python's ctypes:
// one model and context of libllama, driven over stdin/stdout.
//
//   llama_cpp_logits_server MODEL.gguf N_GPU_LAYERS N_CTX N_BATCH N_UBATCH
//
// After loading it writes the vocabulary size (int32). Then, per line on stdin:
//   "c"                   clear the memory (sequence 0); writes int32 0
//   "d START N T1 .. TN"  decode T1..TN at positions START.. with logits for every one;
//                         writes int32 status (llama_decode's) and, if 0, N x vocab float32
//   "q"                   quit
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void put_i32(int32_t v) {
    fwrite(&v, sizeof v, 1, stdout);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MODEL N_GPU_LAYERS N_CTX N_BATCH N_UBATCH\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = atoi(argv[2]);
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "could not load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)atoi(argv[3]);
    cp.n_batch = (uint32_t)atoi(argv[4]);
    cp.n_ubatch = (uint32_t)atoi(argv[5]);
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "could not make a context for %s\n", argv[1]);
        return 1;
    }
    const int32_t vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    put_i32(vocab);

    char cmd[2];
    while (scanf("%1s", cmd) == 1 && cmd[0] != 'q') {
        if (cmd[0] == 'c') {
            llama_memory_clear(llama_get_memory(ctx), true);
            put_i32(0);
            continue;
        }
        int start, n;
        if (cmd[0] != 'd' || scanf("%d %d", &start, &n) != 2 || n <= 0 || n > (int)cp.n_batch) {
            fprintf(stderr, "bad command\n");
            return 2;
        }
        struct llama_batch batch = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            if (scanf("%d", &batch.token[i]) != 1) {
                fprintf(stderr, "bad token list\n");
                return 2;
            }
            batch.pos[i] = start + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        batch.n_tokens = n;
        const int32_t rc = llama_decode(ctx, batch);
        fwrite(&rc, sizeof rc, 1, stdout);
        if (rc == 0) {
            fwrite(llama_get_logits(ctx), sizeof(float), (size_t)n * vocab, stdout);
        }
        fflush(stdout);
        llama_batch_free(batch);
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
