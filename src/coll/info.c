/* What this build contains. */
#include "coll/gs_collective.h"

const char *gs_version(void) { return GS_VERSION_STRING; }

int gs_check_payload_bytes(void) { return GS_CHECK_PAYLOAD_BYTES; }
