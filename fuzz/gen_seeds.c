/* Writes the IPC descriptor seed corpus (fuzz/ipc_seeds.h) into a
 * directory, one file per seed: gen_seeds DIR. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "ipc_seeds.h"

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    if (mkdir(argv[1], 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "%s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    ipc_seed_list_t seeds = ipc_seeds_build();
    for (size_t i = 0; i < seeds.n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s.bin", argv[1], seeds.v[i].name);
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(seeds.v[i].bytes, 1, seeds.v[i].len, f) != seeds.v[i].len) {
            fprintf(stderr, "%s: cannot write\n", path);
            if (f) fclose(f);
            return 1;
        }
        fclose(f);
    }
    printf("wrote %zu seeds to %s\n", seeds.n, argv[1]);
    ipc_seeds_free(&seeds);
    return 0;
}
