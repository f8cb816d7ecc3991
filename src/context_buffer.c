/* (filled by its issue) */
#include "internal.h"
