/* gradsync: symbol visibility and version. */
#ifndef GRADSYNC_EXPORT_H
#define GRADSYNC_EXPORT_H

#define GS_VERSION_MAJOR 0
#define GS_VERSION_MINOR 1
#define GS_VERSION_PATCH 0
#define GS_VERSION_STRING "0.1.0"
#define GS_VERSION_CODE (GS_VERSION_MAJOR * 10000 + GS_VERSION_MINOR * 100 + GS_VERSION_PATCH)

/* The library is built with -fvisibility=hidden; only GS_API names export. */
#if defined(GS_BUILDING_LIBRARY) && defined(__GNUC__)
#define GS_API __attribute__((visibility("default")))
#else
#define GS_API
#endif

#endif
