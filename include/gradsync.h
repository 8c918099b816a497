/* gradsync: collective communication for distributed training.
 *
 * Umbrella header: include this one. Link with -lgradsync and compile with
 * the MPI compiler wrapper (mpicc) of the MPI gradsync was built against. */
#ifndef GRADSYNC_H
#define GRADSYNC_H

#include "gs_export.h"
#include "gs_status.h"
#include "gs_types.h"
#include "gs_comm.h"
#include "gs_collectives.h"
#include "gs_shard.h"
#include "gs_info.h"
#include "gs_kernels.h"
#include "gs_device.h"
#include "gs_async.h"
#include "gs_p2p.h"
#include "gs_timeline.h"
#include "gs_flight.h"

#endif
