/* The public header alone, as strict C11; linked against the shared library. */
#include <cubuf.h>
#include <stdio.h>

int main(void)
{
    if (cubuf_version() != CUBUF_VERSION) return 1;
    printf("cubuf %s\n", cubuf_version_string());
    return 0;
}
